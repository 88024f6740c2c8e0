"""How a fresh diffusion drafter should start: training loss and slot accuracy by initialisation, same features and steps.

    python -m bench.diffusion_init [--recipe recipes/smollm2-135m-diffusion.yaml] [--samples 56] [--epochs 8]
                                   [--inits random,target_layers,target_layers+context] [--no-append]

The recipe's first ``--samples`` training samples are captured once (features held in RAM);
then, for each initialisation, a drafter is built with the recipe's config and trained for
``--epochs`` passes over them in batches of 4 (AdamW at the recipe's lr, no warmup, the recipe's
loss and anchors), seeded identically. Initialisations:

- ``random``: PyTorch's default for the layers and fc, output projections zeroed (identity layers);
- ``target_layers``: layer i a copy of the target's decoder layer L - n + i, fc random;
- ``target_layers+context``: the same, and fc / hidden_norm passing the fused feature of that
  layer's input through unchanged (``DiffusionDrafter.init_from_target``, the recipe default).

Printed and, unless ``--no-append``, written over this benchmark's section of BENCHMARKS.md (the
section it replaces moves to bench/HISTORY.md): the per-block loss and the mean slot accuracies
(first slot, all slots) over windows of steps.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench.machine import cpu_name
from bench.runs import main_with_errors
from bench.sections import append_run

REPO = Path(__file__).resolve().parent.parent
INITS = ("random", "target_layers", "target_layers+context")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default=str(REPO / "recipes" / "smollm2-135m-diffusion.yaml"))
    p.add_argument("--samples", type=int, default=56)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--inits", default=",".join(INITS))
    p.add_argument("--no-append", action="store_true")
    return p.parse_args(argv)


def build(init: str, drafter_cfg, target, samples):
    from draftlab.models.diffusion import DiffusionDrafter

    torch.manual_seed(0)
    m = DiffusionDrafter.build(drafter_cfg.model_copy(update={"init_from_target": init != "random"}), target, samples)
    if init == "target_layers":  # undo the context half of init_from_target: a fresh random fc, unit gain
        torch.manual_seed(1)
        m.fc.reset_parameters()
        with torch.no_grad():
            m.hidden_norm.weight.fill_(1.0)
    return m


def run(argv, args) -> int:
    from draftlab.data.capture import capture_batch
    from draftlab.data.dataset import build_samples, collate
    from draftlab.models.target import Target
    from draftlab.recipe import load_recipe

    started = datetime.now(timezone.utc)
    inits = [x for x in args.inits.split(",") if x]
    if set(inits) - set(INITS):
        raise SystemExit(f"--inits: unknown {sorted(set(inits) - set(INITS))} (known: {', '.join(INITS)})")
    recipe = load_recipe(args.recipe)
    _, drafter_cfg, loss_cfg = recipe.algorithm_configs()
    target = Target.load(recipe.target.model)
    samples = build_samples(recipe.data, target.tokenizer).train[: args.samples]
    probe = build("random", drafter_cfg, target, samples)
    batches = []
    for i in range(0, len(samples) - 3, 4):
        b = collate(samples[i : i + 4], target.tokenizer.pad_token_id or 0)
        hidden = capture_batch(target, b["input_ids"], probe.capture_layers, attention_mask=b["attention_mask"])
        b.update(probe.derived_targets(hidden, b))
        batches.append((b, hidden))
    rows = []
    for init in inits:
        m = build(init, drafter_cfg, target, samples).train()
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=recipe.train.lr)
        torch.manual_seed(2)  # the same anchors for every init
        hist, t0 = [], time.perf_counter()
        for _ in range(args.epochs):
            for b, hidden in batches:
                loss, met = m.training_loss(b, hidden, loss_cfg)
                opt.zero_grad()
                loss.backward()
                opt.step()
                hist.append((loss.item(), met["acc"][0], sum(met["acc"]) / len(met["acc"])))
        rows.append((init, hist, time.perf_counter() - t0))
        print(f"{init}: {len(hist)} steps in {rows[-1][2]:.0f} s", flush=True)
    n = len(rows[0][1])
    windows = [(0, 1)] + [(a, min(a + n // 4, n)) for a in range(0, n, n // 4) if a + n // 4 <= n]
    head = ["init"] + [f"steps {a}-{b - 1}: loss / acc1 / acc mean" for a, b in windows]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for init, hist, _ in rows:
        cells = [init]
        for a, b in windows:
            w = hist[a:b]
            cells.append(" / ".join(f"{sum(x[k] for x in w) / len(w):.{2 if k else 1}f}" for k in range(3)))
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_append:
        note = (f"Machine: {cpu_name()}. {len(samples)} training samples of the recipe's data, {len(batches)} batches of 4, "
                f"{args.epochs} epochs; loss = the recipe's block loss per block (loss.kind {loss_cfg.kind}), acc = agreement "
                f"with the target's greedy token (slot 1, and the mean over the {probe.block_size - 1} slots), each averaged over "
                "the steps of the window.\n\n")
        append_run("Diffusion drafter: initialisation", started, "bench.diffusion_init", argv, note + text)
    return 0


if __name__ == "__main__":
    sys.exit(main_with_errors("bench.diffusion_init", parse_args, run))
