"""Drafter families at about equal training time: acceptance curves and speculative decoding per run.

    python -m bench.families RUN_DIR [RUN_DIR ...] [--num-prompts 8] [--max-new-tokens 64]
                             [--static-tree JSON] [--same-tree] [--pair RUN=BASE ...] [--threads N]
                             [--plot PATH.png] [--no-append] [--quick]

Each RUN_DIR is the ``output_dir`` of a finished training run (e.g. runs/smollm2-135m-eagle3 and
runs/smollm2-135m-medusa, trained for about the same CPU minutes), or one of its checkpoints
(``runs/x/checkpoints/step-0000158``: the run measured at that step, named ``x@158``, for equal
minutes with a shorter run). Per run:

1. From the run's own files, nothing re-measured: every after-checkpoint report
   ``eval/step-*.json`` (held-out speculative decoding, the recipe's eval shape) paired with the
   training minutes at that step from ``metrics.jsonl`` (``elapsed_s``: training time including
   target capture, excluding evaluation). One PNG plots held-out first-position acceptance
   alpha_1 against training minutes, one line per run, points marked.
2. Measured now at the run's best checkpoint (``checkpoints/best``, else the last ``step-*``),
   on the target the run was trained for (the recipe's ``target.model``):
   - teacher-forced per-position top-1 and top-5 agreement with the target's greedy token on the
     held-out conversations of the run's own data split, through the family's own
     ``training_loss`` metrics (``acc``: top-1 per head / TTT step; ``top5`` where the family
     reports it, "–" otherwise), micro-batched by the recipe's ``train.batch_tokens`` and
     averaged over batches weighted by the positions each one counts;
   - speculative decoding through ``inference.evaluate.evaluate`` (greedy, plain decoding timed
     back to back on every prompt: speedup = speculative tok/s / plain tok/s of the same run,
     greedy match = prompts whose tokens equal plain decoding's) on ``sharegpt-heldout`` (the
     run's held-out split) and ``spec-bench`` (first turns, round-robin over categories; rows
     skipped with a note when the questions are not found), for two shapes: the recipe's chain
     (``eval.k``; a block of ``eval.k`` for block drafters) and a tree: the recipe's
     ``eval.tree`` dynamic tree where the family drafts one, else a static tree from
     ``--static-tree``, else none; ``--same-tree``: ``--static-tree`` for every family that
     drafts static trees (Hydra++ against Medusa at the same tree).

``--pair RUN=BASE`` (run directory names, repeatable): RUN's α_j and τ minus BASE's on every
prompt set and shape both decoded, paired per prompt (the same prompts: both recipes hold out the
same conversations) with a bootstrap over prompts (``inference.paired``).

Output: one Markdown table (rows: run x prompt set x shape), the paired differences, the acceptance-curve points, and,
unless ``--no-append`` or ``--quick``, this benchmark's section of BENCHMARKS.md rewritten with the
command, the tables, the machine load and the PNG's path (the section it replaces moves to
bench/HISTORY.md; PNG default bench/figures/families-<UTC time>.png then, otherwise a PNG only
with ``--plot``). ``--quick``: 2 prompts x 16 tokens, BENCHMARKS.md untouched. On a machine
whose load exceeds its cores, run with ``--threads 1`` (bench/e2e.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.machine import LoadWindow, cpu_name, load_note
from bench.runs import checkpoint_of, heldout_of, main_with_errors, recipe_of, target_of
from bench.sections import append_run

from draftlab.errors import DraftlabError

REPO = Path(__file__).resolve().parent.parent
DEFAULT_STATIC_TREE = "[[0],[1],[0,0],[0,0,0]]"
PROMPT_SETS = ("sharegpt-heldout", "spec-bench")
DASH = "–"


# ------------------------------------------------------------------------------ the runs' own files
def elapsed_by_step(run: Path) -> dict[int, float]:
    """step -> training seconds, from the trainer's records (the last record of a step wins:
    a resumed run repeats the steps after its checkpoint)."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise DraftlabError(f"{path}: not found (pass a training run's output_dir)")
    out = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise DraftlabError(f"{path}:{n}: not valid JSON") from None
        if isinstance(rec, dict) and "elapsed_s" in rec and "step" in rec:
            out[int(rec["step"])] = float(rec["elapsed_s"])
    return out


def minutes_at(step: int, elapsed: dict[int, float]) -> float:
    """Training minutes at ``step``; NaN when the run logged no record for it (train.log_every)."""
    return elapsed[step] / 60 if step in elapsed else math.nan


def acceptance_curve(run: Path, elapsed: dict[int, float]) -> list[dict]:
    """One point per after-checkpoint report, oldest first."""
    reports = sorted((run / "eval").glob("step-*.json"))
    if not reports:
        raise DraftlabError(f"{run}: no eval/step-*.json reports (did the run reach a checkpoint with eval enabled?)")
    points = []
    for path in reports:
        try:
            rep = json.loads(path.read_text())
            step = int(rep["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise DraftlabError(f"{path}: not an after-checkpoint report ({e})") from None
        alpha = rep.get("alpha") or []
        points.append({
            "step": step, "train_min": minutes_at(step, elapsed), "alpha1": alpha[0] if alpha else None,
            "tau": rep.get("tau"), "speedup": rep.get("speedup"), "greedy": rep.get("greedy_match"),
            "shape": shape_name_from_report(rep), "eval": f"{rep.get('num_prompts')} × {rep.get('max_new_tokens')} tok, {rep.get('data')}",
        })
    return sorted(points, key=lambda p: p["step"])


def shape_name_from_report(rep: dict) -> str:
    if rep.get("method") == "tree" and rep.get("tree"):
        t = rep["tree"]
        return f"tree d{t['depth']}/k{t['top_k']}/n{t['total_tokens']}"
    if rep.get("method") == "static_tree":
        return f"static tree {json.dumps(rep.get('static_tree'), separators=(',', ':'))}"
    return f"{rep.get('method')} k={rep.get('k')}"


def load_run(run_arg: str) -> dict:
    """Everything read from one run directory (or one of its checkpoints: the run measured at that
    step, named ``run@step``), checked before any model loads."""
    from draftlab.checkpoint import META, read_meta

    path = Path(run_arg)
    if not path.is_dir():
        raise DraftlabError(f"{path}: no such run directory")
    at_step = (path / META).is_file()
    run = path.parent.parent if at_step else path  # <run>/checkpoints/<checkpoint>
    elapsed = elapsed_by_step(run)
    curve = acceptance_curve(run, elapsed)
    ckpt = path if at_step else checkpoint_of(run)
    meta = read_meta(ckpt)
    recipe = recipe_of(ckpt, meta)
    step = int(meta.get("step", -1))
    minutes = minutes_at(step, elapsed)
    if math.isnan(minutes) and "elapsed_s" in (meta.get("metrics") or {}):
        minutes = float(meta["metrics"]["elapsed_s"]) / 60  # the trainer's metrics at that checkpoint
    name = run.resolve().name + (f"@{step}" if at_step else "")
    return {"run": run, "name": name, "algorithm": meta["algorithm"], "ckpt": ckpt, "meta": meta,
            "recipe": recipe, "step": step, "train_min": minutes, "curve": curve}


# ------------------------------------------------------------------------------ measured now
def agreement(r: dict, target, drafter, samples: list) -> dict:
    """Teacher-forced top-1 / top-5 agreement per position from the family's ``training_loss``
    metrics. Each micro-batch's metric is a mean over the positions it counts at that draft
    position (x_{t+2+i} an assistant token, both families' convention), so batches are
    combined weighted by those counts."""
    import torch

    from draftlab.data.dataset import batches_by_tokens, collate

    _, _, loss_cfg = r["recipe"].algorithm_configs()
    pad_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    sums: dict[str, list[float]] = {}
    weights: list[float] = []
    for indices in batches_by_tokens(samples, r["recipe"].train.batch_tokens, seed=0, epoch=0):
        batch = {k: v.to(target.device) for k, v in collate([samples[i] for i in indices], pad_id).items()}
        with torch.no_grad():
            hidden = target(batch["input_ids"], layers=drafter.capture_layers, logits=None).hidden
            batch.update(drafter.derived_targets(hidden, batch))
            _, metrics = drafter.training_loss(batch, hidden, loss_cfg)
        mask = batch["loss_mask"].bool()
        for key in ("acc", "top5"):
            if key not in metrics:
                continue
            vals = metrics[key]
            w = [float(mask[:, 2 + i:].sum()) for i in range(len(vals))]
            acc = sums.setdefault(key, [0.0] * len(vals))
            for i, (v, wi) in enumerate(zip(vals, w)):
                acc[i] += v * wi
            if key == "acc":
                weights = [a + b for a, b in zip(weights, w)] if weights else w
    out = {"positions": [int(w) for w in weights], "samples": len(samples)}
    for key, name in (("acc", "top1"), ("top5", "top5")):
        out[name] = [s / w if w else None for s, w in zip(sums[key], weights)] if key in sums else None
    return out


def shapes_for(r: dict, proposer, static_tree, same_tree: bool = False) -> list[tuple[str, object | None, str | None]]:
    """(name, shape or None, why skipped) for the run's chain (a block for block drafters) and its
    tree (``same_tree``: the static tree wherever the family drafts one)."""
    from draftlab.inference.shapes import Block, Chain, DynamicTree

    e = r["recipe"].eval
    out = [(f"chain k={e.k}", Chain(e.k), None) if "chain" in proposer.shapes else (f"block k={e.k}", Block(e.k), None)]
    if "dynamic_tree" in proposer.shapes and not (same_tree and "static_tree" in proposer.shapes):
        t = e.tree
        out.append((f"tree d{t.depth}/k{t.top_k}/n{t.total_tokens}", DynamicTree(t.depth, t.top_k, t.total_tokens), None))
    elif "static_tree" in proposer.shapes:
        choices = json.dumps([list(p) for p in static_tree.choices], separators=(",", ":"))
        out.append((f"static tree {choices}", static_tree, None))
    else:
        out.append(("tree", None, f"{r['algorithm']} drafts no tree"))
    return out


def probe_shapes(target, proposer, shapes, prompt_ids, eos) -> None:
    """Two tokens of every shape first, so a shape the drafter cannot fill (a static tree deeper
    than its heads, say) fails in seconds, not after the other measurements."""
    from draftlab.inference.decoder import SpeculativeDecoder

    decoder = SpeculativeDecoder(target, proposer)
    for _, shape, _ in shapes:
        if shape is not None:
            decoder.generate(prompt_ids, 2, shape, eos_token_id=eos)


def measure_run(r: dict, args, static_tree, spec_bench_note: str | None) -> list[dict]:
    """The measured rows of one run: agreement once, then every prompt set x shape."""
    from draftlab.checkpoint import load_drafter
    from draftlab.inference.evaluate import evaluate
    from draftlab.inference.prompts import load_prompts
    from draftlab.inference.proposer import load_proposer

    target = target_of(r["recipe"])
    eos = target.tokenizer.eos_token_id
    label = f"{r['algorithm']} {r['name']}"
    print(f"\n== {label}: {r['ckpt']} (step {r['step']}, {r['train_min']:.1f} training min)", flush=True)
    drafter, _ = load_drafter(r["ckpt"], target)
    proposer = load_proposer(r["ckpt"], target)
    shapes = shapes_for(r, proposer, static_tree, args.same_tree)
    prompt_sets = {"sharegpt-heldout": load_prompts("sharegpt-heldout", target.tokenizer, args.num_prompts, data_spec=r["recipe"].data)}
    if spec_bench_note is None:
        prompt_sets["spec-bench"] = load_prompts("spec-bench", target.tokenizer, args.num_prompts)
    probe_shapes(target, proposer, shapes, prompt_sets["sharegpt-heldout"][0].prompt_ids, eos)

    t0 = time.perf_counter()
    agree = agreement(r, target, drafter, heldout_of(r["recipe"], r["run"], target, r["run"]))
    print(f"agreement on {agree['samples']} held-out samples ({time.perf_counter() - t0:.1f} s): top-1 "
          f"{fmt_list(agree['top1'])}, top-5 {fmt_list(agree['top5'])}", flush=True)
    del drafter
    rows = []
    for data in PROMPT_SETS:
        for shape_name, shape, why in shapes:
            row = {"label": label, "run": r, "data": data, "shape": shape_name, "agree": agree}
            if data not in prompt_sets:
                rows.append({**row, "skipped": "Spec-Bench questions not found"})
                continue
            if shape is None:
                rows.append({**row, "skipped": why})
                continue

            def progress(i, n, res, tag=f"{label} {data} {shape_name}"):
                print(f"[{tag} {i + 1}/{n}] tau={res.stats().tau:.2f} {res.tokens_per_s:.1f} tok/s", flush=True)

            rep = evaluate(target, proposer, prompt_sets[data], shape=shape, max_new_tokens=args.max_new_tokens,
                           seed=r["recipe"].seed, eos_token_id=eos, baseline=True, data=data,
                           label=f"{label} {shape_name}", progress=progress)
            rows.append({**row, "report": rep})
    return rows


# ------------------------------------------------------------------------------ output
def fmt(x, digits=2, suffix="") -> str:
    return DASH if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}{suffix}"


def fmt_list(xs) -> str:
    return DASH if xs is None else " / ".join(fmt(x) for x in xs)


def results_table(rows: list[dict]) -> str:
    lines = [
        "| family (run) | step | training min | prompts | shape | top-1 per position | top-5 per position | τ ± 1 s.e. | α_j "
        "| draft ms / step | speedup vs plain | greedy match |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        r, a = row["run"], row["agree"]
        head = (f"| {row['label']} | {r['step']} | {fmt(r['train_min'], 1)} | {row['data']} | {row['shape']} | "
                f"{fmt_list(a['top1'])} | {fmt_list(a['top5'])} |")
        if "skipped" in row:
            lines.append(f"{head} skipped: {row['skipped']} | | | | |")
            continue
        rep = row["report"]
        n = rep["num_prompts"]
        tau = fmt(rep["tau"]) + (f" ± {fmt(rep['tau_se'])}" if rep.get("tau_se") is not None else "")
        draft_ms = 1e3 * rep["draft_time_s"] / rep["num_steps"] if rep.get("num_steps") else None
        lines.append(f"{head} {tau} | {fmt_list(rep['alpha'])} | {fmt(draft_ms, 1)} | {fmt(rep['speedup'], 2, '×')} | "
                     f"{rep['greedy_match'] or DASH} |" + ("" if n else " (no prompts)"))
    return "\n".join(lines)


def paired_table(rows: list[dict], pairs: list[tuple[str, str]]) -> str:
    """RUN − BASE per prompt set and shape both decoded: α_j and τ differences, paired per prompt."""
    from draftlab.inference.paired import bootstrap, pm

    found = {(row["run"]["name"], row["data"], row["shape"]): row["report"] for row in rows if "report" in row}
    lines = ["| run − base | prompts | shape | Δα_j (paired) | Δτ (paired) | prompts better / worse in τ |",
             "|---|---|---|---|---|---|"]
    for name, base in pairs:
        for (run, data, shape), rep in found.items():
            other = found.get((base, data, shape))
            if run != name or other is None:
                continue
            k = min(len(p["reached"]) for p in rep["prompts"] + other["prompts"])
            st = bootstrap({base: other, name: rep}, k, base=base)[name]
            alpha = " / ".join(pm(st["diff"][j], st["diff_se"][j]) for j in range(k))
            lines.append(f"| {name} − {base} | {data} | {shape} | {alpha} | {pm(st['diff'][k], st['diff_se'][k])} | "
                         f"{st['better']} / {st['worse']} |")
    return "\n".join(lines)


def pair_arg(text: str, names: list[str]) -> tuple[str, str]:
    run, sep, base = text.partition("=")
    if not sep or run not in names or base not in names or run == base:
        raise DraftlabError(f"--pair {text}: expected RUN=BASE, two different run directory names of {names}")
    return run, base


def curve_table(runs: list[dict]) -> str:
    lines = ["| family (run) | step | training min | α_1 | τ | speedup vs plain | greedy match | run's evaluation |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        for p in r["curve"]:
            lines.append(f"| {r['algorithm']} {r['name']} | {p['step']} | {fmt(p['train_min'], 1)} | {fmt(p['alpha1'])} | "
                         f"{fmt(p['tau'])} | {fmt(p['speedup'], 2, '×')} | {p['greedy'] or DASH} | {p['shape']}, {p['eval']} |")
    return "\n".join(lines)


def plot_curves(runs: list[dict], path: Path) -> Path:
    """alpha_1 of every after-checkpoint report against training minutes, one line per run."""
    from draftlab.inference.report import figure

    def draw(ax):
        for r in runs:
            pts = [(p["train_min"], p["alpha1"]) for p in r["curve"] if p["alpha1"] is not None and not math.isnan(p["train_min"])]
            if pts:
                xs, ys = zip(*pts)
                shapes = sorted({p["shape"] for p in r["curve"]})
                ax.plot(xs, ys, marker="o", label=f"{r['algorithm']} {r['name']} ({', '.join(shapes)})")
        ax.set_xlabel("training minutes (target capture included, evaluation excluded)")
        ax.set_ylabel(r"held-out $\alpha_1$ (after-checkpoint reports)")
        ax.set_ylim(0, 1.02)
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
        ax.set_title("Drafter families: first-position acceptance vs training time", fontsize=9)

    return figure(draw, path, size=(6.5, 4))


def shown_path(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(REPO))
    except ValueError:
        return str(p)


# ------------------------------------------------------------------------------ main
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="training run directories (a recipe's output_dir)")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per set (round-robin over categories)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--static-tree", default=DEFAULT_STATIC_TREE,
                   help="tree row of families without a dynamic tree: JSON paths of candidate ranks, or a .json file holding them")
    p.add_argument("--same-tree", action="store_true",
                   help="decode --static-tree for every family that drafts static trees, not their dynamic trees")
    p.add_argument("--pair", action="append", default=[], metavar="RUN=BASE",
                   help="RUN's acceptance minus BASE's, paired per prompt (run directory names; repeatable)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--plot", default=None, help="PNG of alpha_1 vs training minutes (default when writing BENCHMARKS.md: bench/figures/families-<time>.png)")
    p.add_argument("--no-append", action="store_true", help="print only, do not rewrite this benchmark's section of BENCHMARKS.md")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 prompts x 16 tokens, BENCHMARKS.md untouched")
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.max_new_tokens = min(args.num_prompts, 2), min(args.max_new_tokens, 16)
    if min(args.num_prompts, args.max_new_tokens) < 1 or (args.threads is not None and args.threads < 1):
        p.error("--num-prompts, --max-new-tokens and --threads must be >= 1")
    return args


def static_tree_arg(value: str):
    from draftlab.inference.shapes import StaticTree

    try:
        text = value if value.lstrip().startswith("[") else Path(value).read_text()
        return StaticTree(json.loads(text))
    except OSError as e:
        raise DraftlabError(f"--static-tree: neither a JSON list nor a readable file: {value} ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise DraftlabError(f"--static-tree: invalid JSON ({e.msg})") from None
    except DraftlabError as e:
        raise DraftlabError(f"--static-tree: {e}") from None


def run(argv, args) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    static_tree = static_tree_arg(args.static_tree)
    runs = [load_run(a) for a in args.runs]  # every run checked before any model loads
    pairs = [pair_arg(x, [r["name"] for r in runs]) for x in args.pair]
    spec_bench_note = None
    try:
        from draftlab.presets import spec_bench_path

        spec_bench_path()
    except DraftlabError as e:
        spec_bench_note = f"{e}: spec-bench rows skipped."
        print(spec_bench_note, flush=True)

    started = datetime.now(timezone.utc)
    measured = LoadWindow()
    rows = [row for r in runs for row in measure_run(r, args, static_tree, spec_bench_note)]
    window = measured.close()
    load_end = " ".join(f"{x:.2f}" for x in os.getloadavg())

    append = not (args.no_append or args.quick)
    plot = Path(args.plot) if args.plot else (REPO / "bench" / "figures" / f"families-{started:%Y%m%d-%H%M}.png" if append else None)
    if plot is not None:
        plot_curves(runs, plot)
        print(f"wrote {plot}")
    machine = (f"Machine: {load_note(window)}; load average {load_end} at end; {torch.get_num_threads()} torch threads, "
               f"{cpu_name()}, torch {torch.__version__}.")
    legend = (
        "Training min: the trainer's elapsed time at the checkpoint's step (target capture included, evaluation "
        "excluded). Top-1 / top-5 per position: teacher-forced agreement with the target's greedy token on the run's "
        "held-out samples (EAGLE: per TTT step, Medusa: per head), from the family's own training metrics; \"–\": "
        "the family does not report it. τ pooled over all verify steps, ± one standard error with prompts as the "
        "sampled units (a difference of two rows: √(s.e.₁² + s.e.₂²), an upper bound, both decode the same prompts). "
        "Draft ms / step: the drafter's time per verify step (all of the shape's drafts, on the host loop). "
        "τ, α_j, speedup (speculative / plain tok/s, paired per prompt in the same "
        "evaluation) and greedy match: greedy speculative decoding, "
        f"{args.num_prompts} prompts × {args.max_new_tokens} new tokens per set, measured now."
    )
    paired = (f"Paired differences (RUN − BASE on the same prompts, ± one bootstrap s.e. over prompts):\n\n"
              f"{paired_table(rows, pairs)}\n\n" if pairs else "")
    text = (f"{results_table(rows)}\n\n{legend}\n\n{paired}"
            f"Acceptance curve (the runs' own after-checkpoint reports{', plotted in `' + shown_path(plot) + '`' if plot else ''}):\n\n"
            f"{curve_table(runs)}\n\n{machine}")
    if spec_bench_note:
        text += f"\n\n{spec_bench_note}"
    print()
    print(text)
    if append:
        append_run("Drafter families at equal training time", started, "bench.families", argv, text)
    return 0


def main(argv=None) -> int:
    return main_with_errors("bench.families", parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
