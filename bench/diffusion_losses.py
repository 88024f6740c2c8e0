"""The block losses compared: one diffusion drafter recipe trained under each loss, same data, steps and seed.

    python -m bench.diffusion_losses [--recipe recipes/smollm2-135m-diffusion.yaml] [--out runs/diffusion-losses]
                                     [--losses ce,streak,ce_streak,dpace] [--set dotted.key=value ...] [--no-append]

1. The recipe's training split is captured once (``data/offline.py``, float32, the drafter's
   target layers) into ``OUT/capture``, so every run reads identical features.
2. For each loss, ``draftlab train RECIPE loss.kind=<loss> output_dir=OUT/<loss>`` with offline
   capture and the ``--set`` overrides (a subprocess each; relaunching the bench resumes
   finished or interrupted runs). Everything else is the recipe's: drafter, steps, seed, and the
   after-checkpoint evaluation (real speculative decoding of held-out prompts, drafting the whole
   block, plain decoding timed back to back).
3. From each run's last report and metrics: a_j and alpha_j for every block position, tau,
   speedup, greedy match, the training accuracy by position, training minutes; and the ratio
   of alpha_j for j >= 3 to that of ``ce`` (the question: does streak-distillation lift the
   later positions?). One PNG of alpha_j by position, one curve per loss.

Unless ``--no-append``, the table and PNG path rewrite this benchmark's section of BENCHMARKS.md
(the section it replaces moves to bench/HISTORY.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.machine import cpu_name
from bench.runs import main_with_errors
from bench.sections import append_run

REPO = Path(__file__).resolve().parent.parent
LOSSES = ("ce", "streak", "ce_streak", "dpace")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default=str(REPO / "recipes" / "smollm2-135m-diffusion.yaml"))
    p.add_argument("--out", default="runs/diffusion-losses")
    p.add_argument("--losses", default=",".join(LOSSES))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override for every run")
    p.add_argument("--no-append", action="store_true")
    return p.parse_args(argv)


def capture(recipe_path: str, overrides: list[str], out: Path) -> Path:
    """The recipe's training split, captured once at the drafter's layers (float32)."""
    from draftlab.data.dataset import build_samples
    from draftlab.data.offline import capture_offline
    from draftlab.models.drafter import DRAFTERS
    from draftlab.models.target import Target
    from draftlab.recipe import load_recipe

    recipe = load_recipe(recipe_path, overrides)
    target = Target.load(recipe.target.model)
    _, drafter_cfg, _ = recipe.algorithm_configs()
    samples = build_samples(recipe.data, target.tokenizer)
    drafter = DRAFTERS.get(recipe.algorithm, "algorithm").build(drafter_cfg, target, samples.train)
    capture_offline(target, samples.train, out, drafter.capture_layers, storage_dtype="float32",
                    data_spec={**recipe.data.model_dump(mode="json"), "split": "train"}, verbose=True)
    return out


def train(recipe_path: str, overrides: list[str], loss: str, run: Path, features: Path) -> None:
    cmd = [sys.executable, "-m", "draftlab.cli", "train", recipe_path, *overrides, f"loss.kind={loss}", f"output_dir={run}",
           "capture.mode=offline", f"capture.offline_dir={features}"]
    print("$ " + " ".join(cmd), flush=True)
    if subprocess.run(cmd, cwd=REPO).returncode:
        raise SystemExit(f"training with loss {loss} failed (relaunch the bench to resume it)")


def result(loss: str, run: Path) -> dict:
    reports = sorted((run / "eval").glob("step-*.json"))
    if not reports:
        raise SystemExit(f"{run}: no eval/step-*.json (did the run reach a checkpoint?)")
    rep = json.loads(reports[-1].read_text())
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = [m for m in metrics if m.get("step") == rep["step"] and "loss" in m]
    return {"loss": loss, "report": rep, "train_min": last[-1]["elapsed_s"] / 60 if last else float("nan")}


def fmt(x, d=2) -> str:
    return "-" if x is None else f"{x:.{d}f}"


def table(rows: list[dict]) -> str:
    J = max(len(r["report"]["alpha"]) for r in rows)
    base = next((r["report"]["alpha"] for r in rows if r["loss"] == "ce"), None)
    head = ["loss", "step", "train min", "tau", "speedup", "greedy"] + [f"α{j}" for j in range(1, J + 1)] + [
        f"a{j}" for j in range(1, J + 1)] + ["train acc 1..J"] + (["mean α_j≥3 / ce's"] if base else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        rep = r["report"]
        alpha, a = rep["alpha"] + [None] * (J - len(rep["alpha"])), rep["a"] + [None] * (J - len(rep["a"]))
        cells = [r["loss"], str(rep["step"]), fmt(r["train_min"], 1), fmt(rep["tau"]), fmt(rep.get("speedup")), str(rep.get("greedy_match"))]
        cells += [fmt(x) for x in alpha] + [fmt(x, 3) for x in a] + [" ".join(fmt(x) for x in rep.get("train_acc", []))]
        if base:
            late = [(x or 0.0, b) for x, b in zip(alpha[2:], base[2:]) if b]
            cells.append(fmt(sum(x for x, _ in late) / sum(b for _, b in late)) if late else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run(argv, args) -> int:
    from draftlab.inference.report import plot_alpha

    started = datetime.now(timezone.utc)
    out = Path(args.out)
    losses = [x for x in args.losses.split(",") if x]
    unknown = sorted(set(losses) - set(LOSSES))
    if unknown:
        raise SystemExit(f"--losses: unknown {unknown} (known: {', '.join(LOSSES)})")
    t0 = time.perf_counter()
    features = out / "capture"
    if not (features / "manifest.json").is_file():
        capture(args.recipe, args.set, features)
    capture_min = (time.perf_counter() - t0) / 60
    rows = []
    for loss in losses:
        run_dir = out / loss
        train(args.recipe, args.set, loss, run_dir, features)
        rows.append(result(loss, run_dir))
    text = table(rows)
    print(text)
    figure = REPO / "bench" / "figures" / f"diffusion-losses-{started:%Y%m%d-%H%M}.png"
    plot_alpha([r["report"] for r in rows], figure, labels=[r["loss"] for r in rows])
    print(f"plot: {figure}")
    if not args.no_append:
        note = (f"Machine: {cpu_name()}. Capture of the training split once: {capture_min:.1f} min (0 when reused). "
                f"Each row: its run's last after-checkpoint report (held-out prompts, the whole block drafted, greedy); "
                f"a_j = P(accepted >= j), α_j = a_j / a_(j-1). Plot: `{figure.relative_to(REPO)}`.\n\n")
        append_run("Diffusion drafter: block losses at equal data, steps and seed", started, "bench.diffusion_losses", argv, note + text)
    return 0


if __name__ == "__main__":
    sys.exit(main_with_errors("bench.diffusion_losses", parse_args, run))
