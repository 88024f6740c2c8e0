"""Medusa static trees built from the heads' measured accuracies (the Medusa paper's sparse trees), measured end to end.

    python -m bench.medusa_tree CHECKPOINT [--sizes 1,2,3,4,6,8,12,16] [--num-prompts 8]
                                [--max-new-tokens 64] [--threads N] [--no-append] [--quick]

CHECKPOINT is a Medusa checkpoint directory (e.g. runs/smollm2-135m-medusa/checkpoints/best; a
run's ``output_dir`` stands for its ``checkpoints/best``, else its last ``step-*``). Medusa
decodes with a static tree given as ``choices``: paths of per-level candidate ranks, path
(r_1, ..., r_d) = head 0's rank-r_1 token, then head 1's rank-r_2 token, ... (node tokens do not
depend on their parent: Medusa's Cartesian candidates, ``inference/medusa.py``). Which tree is
best depends on the heads' accuracies and on what verifying N + 1 tokens costs on this machine,
so this script builds the candidates from the former and measures the latter:

1. **Head accuracies.** Teacher-forced on the held-out samples of the checkpoint's own recipe
   (its data split, tokenised as in training), on the target the run was trained for: for
   head i and rank r < R (R = 10, or the draft vocabulary if smaller), acc[i][r] = the share of
   counted positions t (x_{t+2+i} an assistant token, the loss's ``predicted_mask``) at which
   the target's greedy token for x_{t+2+i} (``derived_targets``' ``target_argmax`` at t+1+i) is
   head i's r-th most likely draft token (``head_logits`` -> ``to_target_ids``; a token outside
   the draft vocabulary is a miss at every rank). Micro-batched by the recipe's
   ``train.batch_tokens``.
2. **Trees (Medusa paper, sparse tree construction).** Under the independence approximation a
   path (r_1, ..., r_d) is accepted with probability prod_j acc[j-1][r_j], and a tree's expected
   accepted length is the sum of its nodes' path probabilities (expected τ = 1 + that sum).
   Greedy growth: start empty and repeatedly add, among the nodes whose parent is in the tree
   (or of depth 1), the one of highest path probability (ties: shallower, then smaller ranks),
   depth <= number of heads; the tree after N additions is the candidate of size N, for every N
   in ``--sizes`` (so the candidates are nested). Every tree's choices and expected τ are printed.
3. **Measured.** Every candidate, and the plain chain ``Chain(num_heads)`` (one draft per head)
   for reference, through ``inference.evaluate.evaluate`` on ``sharegpt-heldout`` (the recipe's
   held-out prompts): greedy, plain decoding timed back to back with the speculative run on every
   prompt (speedup = speculative tok/s / plain tok/s of the same evaluation; greedy match =
   prompts whose tokens equal plain decoding's). Per step: draft and verify time (the report's
   ``draft_time_s`` / ``verify_time_s`` over its verify steps; verify = target forward of the
   N + 1 tree tokens, verification and cache roll-back), against plain decoding's time per token
   (its total time / its tokens, prefill included).

Output: the accuracy table, the Markdown results table and the best tree by measured speedup
(ties at the printed precision: the smaller tree), with its choices as JSON; unless
``--no-append`` or ``--quick``, this benchmark's section of BENCHMARKS.md rewritten with the command,
the tables, the chosen choices and the machine load (the section it replaces moves to
bench/HISTORY.md). ``--quick``: 2 prompts x 16 tokens, sizes 1,2,4 (unless ``--sizes`` is given),
BENCHMARKS.md untouched. On a machine whose load exceeds its cores, run with
``--threads 1`` (bench/e2e.py). Runtime: (number of distinct trees + 1) evaluations, each of
``--num-prompts`` plain and speculative generations of ``--max-new-tokens`` tokens, plus one
target forward over the held-out samples.
"""

from __future__ import annotations

import argparse
import heapq
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

PROG = "bench.medusa_tree"
DEFAULT_SIZES = "1,2,3,4,6,8,12,16"
QUICK_SIZES = "1,2,4"
TOP_R = 10  # ranks per head whose accuracy is measured (and the widest a node's rank can be)
DASH = "–"

Path_ = tuple[int, ...]


# ------------------------------------------------------------------------------ tree construction
def path_probability(acc: list[list[float]], path: Path_) -> float:
    """prod_j acc[j][path[j]]: the path's acceptance probability under independence."""
    p = 1.0
    for head, rank in enumerate(path):
        p *= acc[head][rank]
    return p


def expected_tau(acc: list[list[float]], choices) -> float:
    """1 + the sum of the tree's path probabilities (the expected accepted length plus the
    target's own token)."""
    return 1.0 + sum(path_probability(acc, tuple(p)) for p in choices)


def grow_trees(acc: list[list[float]], sizes: list[int], max_depth: int | None = None) -> dict[int, list[Path_]]:
    """Size -> the greedily grown tree of that many nodes (Medusa's sparse tree): best-first over
    the frontier (depth-1 nodes and children of tree nodes), highest path probability first,
    ties by depth, then ranks. A child never beats its parent (factors <= 1), so this is also
    the greedy choice over all nodes whose parent is present. Sizes beyond the number of
    possible nodes are left out. The trees are nested; each list is in insertion order."""
    depth = len(acc) if max_depth is None else min(max_depth, len(acc))
    ranks = [len(row) for row in acc]
    if depth < 1 or not ranks or min(ranks[:depth]) < 1:
        return {}
    wanted = sorted({s for s in sizes if s >= 1})
    frontier = [(-acc[0][r], 1, (r,)) for r in range(ranks[0])]
    heapq.heapify(frontier)
    tree: list[Path_] = []
    out: dict[int, list[Path_]] = {}
    while frontier and wanted and len(tree) < wanted[-1]:
        neg_p, d, path = heapq.heappop(frontier)
        tree.append(path)
        if len(tree) in wanted:
            out[len(tree)] = list(tree)
        if d < depth:
            for r in range(ranks[d]):
                heapq.heappush(frontier, (neg_p * acc[d][r], d + 1, path + (r,)))
    return out


def short_choices(choices, limit: int | None = None) -> str:
    """Compact tree notation: each path as its ranks' digits (ranks < 10), paths by depth then
    lexicographically, e.g. ``0 1 00 01 000``; JSON when a rank has two digits. With ``limit``,
    the first ``limit`` paths and a count of the rest."""
    paths = sorted((tuple(p) for p in choices), key=lambda p: (len(p), p))
    if not all(r < 10 for p in paths for r in p):
        return as_json(paths)
    shown = paths if limit is None else paths[:limit]
    more = len(paths) - len(shown)
    return " ".join("".join(map(str, p)) for p in shown) + (f" … (+{more})" if more else "")


def as_json(choices) -> str:
    return json.dumps([list(p) for p in sorted((tuple(p) for p in choices), key=lambda p: (len(p), p))], separators=(",", ":"))


# ------------------------------------------------------------------------------ the checkpoint
def load_checkpoint(arg: str) -> dict:
    """Checkpoint, meta and recipe, checked before any model loads."""
    from draftlab.checkpoint import read_meta

    ckpt = checkpoint_of(Path(arg))
    meta = read_meta(ckpt)
    if meta["algorithm"] != "medusa":
        raise DraftlabError(f"{ckpt}: a '{meta['algorithm']}' checkpoint, not a Medusa one (static trees of candidate ranks are Medusa's)")
    run = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None
    return {"ckpt": ckpt, "meta": meta, "recipe": recipe_of(ckpt, meta), "run": run, "step": int(meta.get("step", -1))}


# ------------------------------------------------------------------------------ head accuracies
def head_accuracies(drafter, target, samples: list, batch_tokens: int, top_r: int = TOP_R) -> dict:
    """Teacher-forced acc[i][r]: the share of head i's counted positions whose target greedy
    token is the head's r-th most likely draft token (module docstring, step 1)."""
    import torch

    from draftlab.data.dataset import batches_by_tokens, collate
    from draftlab.losses.eagle import predicted_mask, shift_left

    H = drafter.num_heads
    R = min(top_r, drafter.draft_vocab_size)
    hits = torch.zeros(H, R, dtype=torch.long)
    counts = [0] * H
    pad_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    for indices in batches_by_tokens(samples, batch_tokens, seed=0, epoch=0):
        batch = {k: v.to(target.device) for k, v in collate([samples[i] for i in indices], pad_id).items()}
        with torch.no_grad():
            hidden = target(batch["input_ids"], layers=drafter.capture_layers, logits=None).hidden
            greedy = drafter.derived_targets(hidden, batch)["target_argmax"]  # [B, T]; -1 where unused
            final = hidden[drafter.num_target_layers]
            for i in range(H):
                counted = predicted_mask(batch["loss_mask"], i)  # x_{t+2+i} is an assistant token
                ref = shift_left(greedy, 1 + i, fill=-1)[counted]  # the target's token for x_{t+2+i}
                if not ref.numel():
                    continue
                ranked = drafter.to_target_ids(drafter.head_logits(final[counted], i).topk(R, dim=-1).indices)
                hits[i] += (ranked == ref[:, None]).sum(0).cpu()
                counts[i] += int(ref.numel())
    acc = [[float(hits[i, r]) / counts[i] if counts[i] else 0.0 for r in range(R)] for i in range(H)]
    return {"acc": acc, "positions": counts, "samples": len(samples), "top_r": R}


# ------------------------------------------------------------------------------ measurement
def measure(c: dict, args) -> dict:
    from draftlab.checkpoint import load_drafter
    from draftlab.inference.evaluate import evaluate
    from draftlab.inference.prompts import load_prompts
    from draftlab.inference.proposer import load_proposer
    from draftlab.inference.shapes import Chain, StaticTree

    recipe = c["recipe"]
    target = target_of(recipe)
    eos = target.tokenizer.eos_token_id
    print(f"== medusa {c['ckpt']} (step {c['step']}), target {recipe.target.model}", flush=True)
    drafter, _ = load_drafter(c["ckpt"], target)
    H = drafter.num_heads

    t0 = time.perf_counter()
    accs = head_accuracies(drafter, target, heldout_of(recipe, c["run"], target, c["ckpt"]), recipe.train.batch_tokens)
    del drafter
    print(f"head accuracies on {accs['samples']} held-out samples ({time.perf_counter() - t0:.1f} s), "
          f"positions per head {accs['positions']}:", flush=True)
    print(accuracy_table(accs), flush=True)

    acc = accs["acc"]
    trees = grow_trees(acc, args.sizes, H)
    missing = [s for s in args.sizes if s not in trees]
    if missing:
        print(f"sizes {missing} left out: {H} heads x {accs['top_r']} ranks allow fewer nodes", flush=True)
    chain = [tuple([0] * d) for d in range(1, H + 1)]
    print("\ncandidate trees (greedy by path probability, expected τ = 1 + sum of path probabilities):", flush=True)
    print(f"  chain k={H}: expected τ {expected_tau(acc, chain):.3f}  {as_json(chain)}", flush=True)
    for n, choices in trees.items():
        print(f"  size {n}: expected τ {expected_tau(acc, choices):.3f}  {as_json(choices)}", flush=True)

    proposer = load_proposer(c["ckpt"], target)
    prompts = load_prompts("sharegpt-heldout", target.tokenizer, args.num_prompts, data_spec=recipe.data)
    shapes = [{"name": f"chain k={H}", "kind": "chain", "nodes": H, "choices": chain, "shape": Chain(H)}]
    shapes += [{"name": f"tree n={n}", "kind": "tree", "nodes": n, "choices": ch, "shape": StaticTree(ch)} for n, ch in trees.items()]
    rows = []
    for s in shapes:
        def progress(i, n, res, tag=s["name"]):
            print(f"[{tag} {i + 1}/{n}] tau={res.stats().tau:.2f} {res.tokens_per_s:.1f} tok/s", flush=True)

        rep = evaluate(target, proposer, prompts, shape=s["shape"], max_new_tokens=args.max_new_tokens,
                       seed=recipe.seed, eos_token_id=eos, baseline=True, data="sharegpt-heldout",
                       label=f"medusa {s['name']}", progress=progress)
        rows.append({**s, "expected_tau": expected_tau(acc, s["choices"]), "report": rep, **step_times(rep)})
    return {"accs": accs, "rows": rows, "heads": H, "prompts": len(prompts)}


def step_times(rep: dict) -> dict:
    """ms per verify step (draft, verify) and plain ms per token from an evaluate report."""
    steps = rep.get("num_steps") or 0
    ms = lambda key: 1000 * rep[key] / steps if steps and rep.get(key) is not None else None  # noqa: E731
    base_tokens, base_time = rep.get("baseline_new_tokens"), rep.get("baseline_time_s")
    plain = 1000 * base_time / base_tokens if base_tokens and base_time else None
    verify = ms("verify_time_s")
    return {"draft_ms": ms("draft_time_s"), "verify_ms": verify, "plain_ms": plain}


def best_tree(rows: list[dict]) -> dict | None:
    """The tree of highest measured speedup; ties at the printed precision go to the smaller."""
    trees = [r for r in rows if r["kind"] == "tree" and r["report"].get("speedup") is not None]
    if not trees:
        return None
    return min(trees, key=lambda r: (-round(r["report"]["speedup"], 2), r["nodes"]))


# ------------------------------------------------------------------------------ output
def fmt(x, digits=2, suffix="") -> str:
    return DASH if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}{suffix}"


def fmt_list(xs) -> str:
    return DASH if not xs else " / ".join(fmt(x) for x in xs)


def accuracy_table(accs: dict) -> str:
    R = accs["top_r"]
    lines = ["| head (predicts) | positions | " + " | ".join(f"r={r}" for r in range(R)) + f" | top-{R} |",
             "|---|---|" + "---|" * (R + 1)]
    for i, (row, n) in enumerate(zip(accs["acc"], accs["positions"])):
        lines.append(f"| {i} (x_t+{i + 2}) | {n} | " + " | ".join(fmt(a, 3) for a in row) + f" | {fmt(sum(row), 3)} |")
    return "\n".join(lines)


def results_table(rows: list[dict], best: dict | None) -> str:
    lines = [
        "| shape | nodes | choices | expected τ | τ | α_j | speedup vs plain | greedy match | draft ms/step "
        "| verify ms/step | plain ms/token |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rep = r["report"]
        name = f"**{r['name']}**" if r is best else r["name"]
        choices = "chain" if r["kind"] == "chain" else f"`{short_choices(r['choices'], limit=24)}`"
        lines.append(
            f"| {name} | {r['nodes']} | {choices} | {fmt(r['expected_tau'])} | {fmt(rep['tau'])} | {fmt_list(rep['alpha'])} | "
            f"{fmt(rep['speedup'], 2, '×')} | {rep['greedy_match'] or DASH} | {fmt(r['draft_ms'], 1)} | "
            f"{fmt(r['verify_ms'], 1)} | {fmt(r['plain_ms'], 1)} |"
        )
    return "\n".join(lines)


def verdict(rows: list[dict], best: dict | None) -> str:
    if best is None:
        return "No tree has a measured speedup (no plain baseline time)."
    chain = next(r for r in rows if r["kind"] == "chain")
    rep = best["report"]
    text = (f"Best tree by measured speedup: **{best['name']}** ({fmt(rep['speedup'], 2, '×')} vs plain, "
            f"τ {fmt(rep['tau'])}, expected τ {fmt(best['expected_tau'])}); {chain['name']}: "
            f"{fmt(chain['report']['speedup'], 2, '×')}, τ {fmt(chain['report']['tau'])}.")
    return text


# ------------------------------------------------------------------------------ main
def parse_sizes(value: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in value.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {value!r}") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"sizes must be integers >= 1, got {value!r}")
    return sizes


def parse_args(argv):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="Medusa checkpoint directory (or a run's output_dir)")
    p.add_argument("--sizes", type=parse_sizes, default=None, help=f"tree sizes (nodes) to build and measure (default {DEFAULT_SIZES}; --quick: {QUICK_SIZES})")
    p.add_argument("--num-prompts", type=int, default=8, help="held-out prompts per evaluation")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--no-append", action="store_true", help="print only, do not rewrite this benchmark's section of BENCHMARKS.md")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 prompts x 16 tokens, sizes 1,2,4, BENCHMARKS.md untouched")
    args = p.parse_args(argv)
    if args.sizes is None:
        args.sizes = parse_sizes(QUICK_SIZES if args.quick else DEFAULT_SIZES)
    if args.quick:
        args.num_prompts, args.max_new_tokens = min(args.num_prompts, 2), min(args.max_new_tokens, 16)
    if min(args.num_prompts, args.max_new_tokens) < 1 or (args.threads is not None and args.threads < 1):
        p.error("--num-prompts, --max-new-tokens and --threads must be >= 1")
    return args


def run(argv, args) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    c = load_checkpoint(args.checkpoint)  # checked before any model loads

    started = datetime.now(timezone.utc)
    measured = LoadWindow()
    res = measure(c, args)
    window = measured.close()
    load_end = " ".join(f"{x:.2f}" for x in os.getloadavg())

    rows, accs = res["rows"], res["accs"]
    best = best_tree(rows)
    machine = (f"Machine: {load_note(window)}; load average {load_end} at end; {torch.get_num_threads()} torch threads, "
               f"{cpu_name()}, torch {torch.__version__}.")
    legend = (
        f"Head accuracies: teacher-forced, on the {accs['samples']} held-out samples of the checkpoint's recipe: share of "
        "head i's counted positions whose target greedy token is the head's rank-r draft token. Trees: greedy Medusa "
        "sparse-tree construction from those accuracies (independence approximation; expected τ = 1 + sum of path "
        "probabilities); choices written as each path's ranks, e.g. `0 1 00` = [[0],[1],[0,0]] (the first 24 paths of larger trees). τ, α_j, speedup "
        "(speculative / plain tok/s, plain timed back to back on every prompt of the same evaluation), greedy match, "
        f"draft and verify ms per verify step: greedy decoding, {res['prompts']} sharegpt-heldout prompts × "
        f"{args.max_new_tokens} new tokens per row; plain ms/token = plain decoding's total time (prefill included) "
        "over its tokens."
    )
    chosen = f"Chosen tree ({best['name']}):\n\n```json\n{as_json(best['choices'])}\n```" if best else ""
    text = (f"Checkpoint `{c['ckpt']}` (step {c['step']}, {res['heads']} heads, target {c['recipe'].target.model}).\n\n"
            f"{accuracy_table(accs)}\n\n{results_table(rows, best)}\n\n{legend}\n\n{verdict(rows, best)}\n\n"
            + (f"{chosen}\n\n" if chosen else "") + machine)
    print()
    print(text)
    if not (args.no_append or args.quick):
        append_run("Medusa static tree from head accuracies", started, PROG, argv, text)
    return 0


def main(argv=None) -> int:
    return main_with_errors(PROG, parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
