"""ReSpec's drafter that follows a moving policy (arXiv 2510.26475) in the rollout workload:
``draftlab rollouts run --methods eagle3-stale,eagle3-kd,eagle3-rkd --drafter CKPT``.

* ``eagle3-stale``: the EAGLE-3 checkpoint as given (trained for policy 0), every epoch;
* ``eagle3-kd``: after each epoch but the last, distilled toward that epoch's policy on its
  rollouts, every rollout weighted alike (online KD);
* ``eagle3-rkd``: the same, each rollout weighted by its reward (ReSpec's reward-weighted KD).

The distillation is :func:`draftlab.train.online_distill.distill` (its docstring states the loss);
inference/ does not import train/, so the command line hands it in as ``distill``. It reads the
epoch's plain rollouts: the policy's own samples, which every lossless method's rollouts follow
in distribution, so kd and rkd distill on the same tokens for the same steps (equal compute).

Every method drafts chains of k, so the report has α_1..α_k per epoch and method. The batch:
a rollout engine decodes many rollouts at once, and a draft that pays at batch 1 can lose at
batch 16 (ReSpec's "diminishing speedups at large batch sizes"). Once per run the costs of a
step drafting k at each batch size are measured on the first policy
(:func:`draftlab.inference.batch_eval.calibrate`: the same rollout prompts decoded plainly and
at each fixed k, at temperature 1), and per epoch and method draftlab's draft-length rule
(:mod:`draftlab.inference.draft_length`) fed that epoch's acceptance says which k (0: none) it
would draft at each batch size. The workload itself decodes one rollout at a time at fixed k
(the α it reports need every position drafted); the rule's choices are what a batched engine
would run.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from draftlab.errors import DraftlabError

# method -> distillation weighting (None: never distilled)
EAGLE_METHODS = {"eagle3-stale": None, "eagle3-kd": "uniform", "eagle3-rkd": "reward"}


@dataclass(frozen=True)
class Rollout:
    """One rollout as the distillation reads it."""

    prompt: list[int]
    response: list[int]
    reward: float = 0.0


def batch_sizes(text: str | None, samples: int, problems: int) -> tuple | None:
    """The draft-length rule's batch sizes from a flag: None (not given) -> 1, the samples of a
    problem and every rollout of an epoch; 'none' -> no calibration; else the sizes listed."""
    from draftlab.inference.batch_eval import parse_batch_sizes

    if text is None:
        return tuple(sorted({1, samples, samples * problems}))
    return None if text.strip().lower() == "none" else tuple(parse_batch_sizes(text))


@dataclass
class OnlineSpec:
    drafter: str | None = None  # the EAGLE-3 checkpoint every method starts from
    steps: int = 8  # distillation steps per epoch (each over all of the epoch's rollouts)
    lr: float = 1e-4
    ttt_steps: int | None = None  # default: the checkpoint's own
    batch_sizes: tuple | None = None  # the draft-length rule's; default 1, samples, problems x samples
    out: Path | None = None  # keeps every epoch's drafters; default a temporary directory

    def check(self, methods, target_spec: str | None = None) -> None:
        """One-line errors before any model loads; with ``target_spec`` (policy 0), a drafter
        trained for another target (shape, vocabulary) is one too."""
        from draftlab.checkpoint import read_meta

        if not any(m in EAGLE_METHODS for m in methods):
            return
        if not self.drafter:
            raise DraftlabError(f"--methods {','.join(m for m in methods if m in EAGLE_METHODS)}: needs --drafter CKPT "
                                "(an EAGLE-3 checkpoint trained on the policy sequence's target)")
        meta = read_meta(self.drafter)
        if meta["algorithm"] != "eagle3":
            raise DraftlabError(f"--drafter {self.drafter}: an EAGLE-3 checkpoint is needed, got algorithm {meta['algorithm']!r}")
        if target_spec is not None:
            _check_target(meta, target_spec, self.drafter)
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 0:
            raise DraftlabError(f"--distill-steps must be an integer >= 0, got {self.steps!r}")
        if not self.lr > 0:
            raise DraftlabError(f"--distill-lr must be > 0, got {self.lr!r}")
        if self.batch_sizes is not None and (not self.batch_sizes or min(self.batch_sizes) < 1):
            raise DraftlabError(f"--batch-sizes: expected integers >= 1, got {self.batch_sizes!r}")


def _check_target(meta: dict, target_spec: str, where) -> None:
    """The checkpoint's target against the policy's config alone (no weights loaded)."""
    from transformers import AutoConfig

    from draftlab.checkpoint import check_target
    from draftlab.models.target import resolve_target

    path, identity = resolve_target(target_spec)
    try:
        cfg = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise DraftlabError(f"policy {target_spec}: cannot read its config ({' '.join(str(e).splitlines())[:200]})") from None
    facts = {"model_type": cfg.model_type, "num_hidden_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
             "vocab_size": cfg.vocab_size}
    check_target(meta, SimpleNamespace(identity={**identity, **facts}), f"--drafter {where}")  # it reads .identity alone


@dataclass
class OnlineDrafters:
    """The EAGLE-3 methods' drafters across a run: which checkpoint each decodes with, each
    epoch's distillation, the measured step costs and each epoch's draft-length choices."""

    spec: OnlineSpec
    methods: list
    distill: object = None  # (drafter_dir, policy, rollouts, out, weighting) -> report dict
    current: dict = field(default_factory=dict)
    epochs: dict = field(default_factory=dict)  # (epoch, method) -> {"checkpoint", "distill", "draft_length"}
    calibration: dict | None = None

    def __post_init__(self):
        self.methods = [m for m in self.methods if m in EAGLE_METHODS]
        if self.distill is None and any(EAGLE_METHODS[m] for m in self.methods):
            raise DraftlabError("eagle3-kd / eagle3-rkd need a distillation function (draftlab rollouts run hands it in)")
        self.current = {m: Path(self.spec.drafter) for m in self.methods}
        self._tmp = None
        if self.spec.out is None and self.methods:
            self._tmp = tempfile.TemporaryDirectory(prefix="respec-")
        self.root = Path(self.spec.out) if self.spec.out is not None else Path(self._tmp.name) if self._tmp else None

    def proposers(self, target, k: int) -> dict:
        """Method -> its proposer for this epoch: its current checkpoint next to ``target``."""
        from draftlab.inference.proposer import load_proposer
        from draftlab.inference.shapes import Chain

        return {m: load_proposer(self.current[m], target, Chain(k)) for m in self.methods}

    def calibrate(self, target, proposer, prompts: list, k: int, max_new_tokens: int, eos, seed: int, log=None) -> None:
        """The step costs of drafting 1..k at each batch size, measured once (they depend on
        shapes, not on the drafter's weights, which every method's share)."""
        from draftlab.inference.batch_eval import Speculation, calibrate
        from draftlab.inference.shapes import Chain

        sizes = sorted(set(self.spec.batch_sizes))
        t0 = time.perf_counter()
        rule = calibrate(target, Speculation(proposer, Chain(k), adaptive=True), prompts, sizes, seed=seed,
                         max_new_tokens=max_new_tokens, temperature=1.0, eos_token_id=eos)
        self.calibration = {"cost": {b: rule.cost[b] for b in sizes}, "batch_sizes": sizes, "seconds": time.perf_counter() - t0,
                            "max_new_tokens": max_new_tokens}
        if log:
            log("draft-length costs per batch size (k = 0.." + str(len(rule.cost[sizes[0]]) - 1) + "): "
                + "; ".join(f"B={b}: " + " ".join(f"{c:.2f}" for c in rule.cost[b]) for b in sizes))

    def rule(self):
        """A fresh draft-length rule on the measured costs (None before :meth:`calibrate`)."""
        from draftlab.inference.draft_length import DraftLength

        if self.calibration is None:
            return None
        return DraftLength({b: list(c) for b, c in self.calibration["cost"].items()})

    def record(self, epoch: int, method: str, rule) -> None:
        """The epoch's decoding: the checkpoint it drafted with and, fed its acceptance, the k the rule picks per batch size."""
        entry = self.epochs.setdefault((epoch, method), {"checkpoint": str(self.current[method]), "distill": None})
        if rule is not None:
            entry["draft_length"] = {"alpha": rule.alpha(), "k": {b: rule(b) for b in self.calibration["batch_sizes"]},
                                     "rate": {b: rule.rate(b, rule(b)) for b in self.calibration["batch_sizes"]}}

    def after_epoch(self, epoch: int, target, rollouts: list[Rollout], log=None) -> None:
        """Distil each distilling method's drafter toward ``target`` (the epoch's policy) on ``rollouts``."""
        for m in self.methods:
            weighting = EAGLE_METHODS[m]
            if weighting is None:
                continue
            out = self.root / m / f"epoch-{epoch + 1:03d}"
            rep = self.distill(self.current[m], target, rollouts, out, weighting)
            self.current[m] = out
            self.epochs.setdefault((epoch, m), {"checkpoint": None, "distill": None})["distill"] = rep
            if log:
                log(f"epoch {epoch} {m}: {rep['steps']} distillation steps over {rep['tokens']} tokens, "
                    f"KL step 1 {rep['kl_before'][0]:.3f} -> {rep['kl_after'][0]:.3f} ({rep['seconds']:.1f} s)")

    def report(self) -> dict:
        """The ``respec`` section of a rollouts report (JSON-ready)."""
        epochs = sorted({e for e, _ in self.epochs})
        distilled = [(e, {m: self.epochs[e, m]["distill"] for m in self.methods if EAGLE_METHODS[m] and (e, m) in self.epochs
                          and self.epochs[e, m]["distill"]}) for e in epochs]
        # equal compute: every distilling method read the same rollouts, tokens and steps asked each epoch
        equal = all(len({(r["rollouts"], r["tokens"], r["steps_asked"], r["policy_forwards"]) for r in reps.values()}) <= 1
                    for _, reps in distilled)
        return {"drafter": str(self.spec.drafter), "distill_steps": self.spec.steps, "distill_lr": self.spec.lr,
                "calibration": self.calibration, "equal_compute": equal,
                "epochs": [{"epoch": e, "method": m, **self.epochs[e, m]} for e, m in sorted(self.epochs)]}

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()


def to_markdown(rep: dict) -> str:
    """The EAGLE-3 methods' tables of a rollouts report: α per epoch, the draft length the rule
    picks per batch size, and each epoch's distillation."""
    r = rep["respec"]
    k = rep["k"]
    sizes = (r["calibration"] or {}).get("batch_sizes") or []
    by = {(e["epoch"], e["method"]): e for e in r["epochs"]}

    def num(x):
        return "–" if x is None else f"{x:.3f}"

    lines = [f"EAGLE-3 drafters across the policy's checkpoints (drafter {r['drafter']}; {r['distill_steps']} distillation steps "
             f"per epoch at lr {r['distill_lr']:g}, on the epoch's plain rollouts):", "",
             "| epoch | method | " + " | ".join(f"α_{j}" for j in range(1, k + 1)) + " | τ |"
             + "".join(f" k at B={b} |" for b in sizes),
             "|---|---|" + "---|" * (k + 1 + len(sizes))]
    for row in rep["rows"]:
        if row["method"] not in EAGLE_METHODS:
            continue
        alpha = (list(row["alpha"]) + [None] * k)[:k]
        ks = (by.get((row["epoch"], row["method"]), {}).get("draft_length") or {}).get("k", {})
        picks = "".join(f" {ks.get(b, ks.get(str(b), '–'))} |" for b in sizes)  # JSON read back: string keys
        lines.append(f"| {row['epoch']} | {row['method']} | " + " | ".join(num(a) for a in alpha) + f" | {row['tau']:.2f} |" + picks)
    if sizes:
        cal = r["calibration"]
        lines += ["", f"Draft-length rule: a step's cost per token over a plain step's, k = 0..{len(next(iter(cal['cost'].values()))) - 1}, "
                  f"measured once on policy 0 ({cal['seconds']:.1f} s, temperature 1, ≤ {cal['max_new_tokens']} tokens): "
                  + "; ".join(f"B={b}: " + " ".join(f"{c:.2f}" for c in cal["cost"].get(b, cal["cost"].get(str(b)))) for b in sizes)
                  + ". k at B: what the rule (draftlab's draft-length rule fed the epoch's α) drafts at B rollouts per batch; 0 = no speculation."]
    dist = [e for e in r["epochs"] if e.get("distill")]
    if dist:
        lines += ["", "| after epoch | method | weighting | steps | rollouts | tokens | Σ weight | KL step 1 before → after | s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for e in dist:
            d = e["distill"]
            lines.append(f"| {e['epoch']} | {e['method']} | {d['weighting']} | {d['steps']}/{d['steps_asked']} | {d['rollouts']} | "
                         f"{d['tokens']} | {d['weight_sum']:g} | {d['kl_before'][0]:.3f} → {d['kl_after'][0]:.3f} | {d['seconds']:.1f} |")
        lines += ["", f"Equal distillation compute (same rollouts, tokens and steps asked): {'yes' if r['equal_compute'] else 'NO'}."]
    return "\n".join(lines) + "\n"
