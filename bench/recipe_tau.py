"""τ reached by recipe runs: one row per after-checkpoint evaluation of each run directory.

    python -m bench.recipe_tau runs/smollm2-135m-eagle3 runs/smollm2-135m-eagle3-full [--no-append]

Reads what the trainer wrote (``metrics.jsonl``: training seconds up to each step;
``eval/step-N.json``: the acceptance report of real speculative decoding on held-out prompts). Nothing is
re-measured here: every number comes from the run itself. Speedup = speculative / plain
tokens/s measured back to back in that evaluation.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

from bench.sections import append_benchmarks


def run_rows(run: Path) -> list[dict]:
    if not (run / "metrics.jsonl").is_file():
        raise SystemExit(f"{run / 'metrics.jsonl'}: not found (pass a recipe's output_dir)")
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = {m["step"]: m for m in metrics if "loss" in m}
    reports = sorted((run / "eval").glob("step-*.json"))
    if not reports:
        raise SystemExit(f"{run}: no eval/step-*.json reports (did the run reach a checkpoint?)")
    rows = []
    for path in reports:
        rep = json.loads(path.read_text())
        step = rep["step"]
        m = train.get(step, {})  # elapsed_s: training seconds summed over resumed launches
        rows.append({
            "run": run.name,
            "step": step,
            "train_min": m.get("elapsed_s", float("nan")) / 60,
            "tau": rep["tau"],
            "alpha": rep["alpha"],
            "speedup": rep["speedup"],
            "greedy": rep["greedy_match"],
            "eval": f"{rep['num_prompts']} × {rep['max_new_tokens']} tok, {rep['method']} k={rep.get('k')}, {rep['data']}, {rep['device']}",
        })
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="run directories (a recipe's output_dir)")
    p.add_argument("--no-append", action="store_true", help="print only, do not rewrite this benchmark's section of BENCHMARKS.md")
    args = p.parse_args(argv)
    rows = [r for run in args.runs for r in run_rows(Path(run))]
    lines = [
        "| run | step | training min | τ | α_j | speedup vs plain | greedy match | evaluation |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        alpha = " / ".join("-" if a is None else f"{a:.2f}" for a in r["alpha"])  # None: no step reached j
        lines.append(f"| {r['run']} | {r['step']} | {r['train_min']:.1f} | {r['tau']:.2f} | {alpha} | {r['speedup']:.2f}× | "
                     f"{r['greedy']} | {r['eval']} |")
    table = "\n".join(lines)
    print(table)
    if not args.no_append:
        cmd = "python -m bench.recipe_tau " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
        append_benchmarks(
            f"\n## τ reached by recipe runs ({datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')})\n\n"
            f"Command: `{cmd}`\n\nFrom each run's own after-checkpoint reports (real speculative decoding on held-out "
            f"prompts; speedup paired with plain decoding in the same evaluation); training minutes = the trainer's "
            f"elapsed time at that step (target capture included, evaluation excluded).\n\n{table}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
