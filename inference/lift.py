"""What one part of a drafter adds: one checkpoint decoded with the part on and off, on the same
prompts, paired per prompt.

A family's proposer names its part by the keyword that switches it (class attribute ``part``:
DFlash2's candidate selector, Domino's GRU correction); off, the proposer drafts from the
backbone alone. Both arms decode by real speculative decoding with the recipe's ``eval:`` spec
(:func:`~draftlab.inference.evaluate.acceptance_report`, greedy output checked against plain
decoding), and the table gives α_j and τ of each with one bootstrap s.e. over prompts and the
part's paired lift (:mod:`~draftlab.inference.paired`); compare on at least 32 prompts
(``eval.num_prompts=32``: sharegpt-heldout reads past the training conversations when the split
holds fewer). A proposer may add ``heldout_rates(drafter, target, samples)``: per-slot rates on the
recipe's held-out samples (DFlash2: each draft's agreement with the target and recall@K).

    python -m draftlab.inference.lift CHECKPOINT --recipe RECIPE [dotted.key=value ...] [--report out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

from draftlab.errors import DraftlabError
from draftlab.inference.paired import bootstrap, pm
from draftlab.inference.proposer import PROPOSERS

BASE = "backbone"


def arms(drafter) -> dict:
    """{part: the proposer with it, "backbone": without}, for a drafter whose family has a part."""
    cls = PROPOSERS.get(drafter.algorithm)
    part = getattr(cls, "part", None)
    if part is None:
        having = ", ".join(f"{n} ({getattr(c, 'part')})" for n, c in PROPOSERS.items() if getattr(c, "part", None))
        raise DraftlabError(f"a {drafter.algorithm} drafter has no part to switch off (families that have one: {having})")
    return {part: cls(drafter, **{part: True}), BASE: cls(drafter, **{part: False})}


def lift(target, drafter, prompts, spec, heldout=(), seed: int = 0, data: str | None = None) -> dict:
    """``reports``: each arm's acceptance report; ``paired``: :func:`~draftlab.inference.paired.bootstrap`
    of the two against the backbone; ``heldout``: the proposer's held-out rates of ``heldout``
    samples where it has them."""
    from draftlab.inference.evaluate import acceptance_report

    eos = getattr(target.tokenizer, "eos_token_id", None)
    proposers = arms(drafter)
    reports = {name: acceptance_report(target, p, prompts, spec, seed=seed, eos_token_id=eos, data=data, label=name)
               for name, p in proposers.items()}
    k = len(reports[BASE]["alpha"])
    rates = getattr(proposers[BASE], "heldout_rates", None)
    return {"part": next(iter(proposers)), "reports": reports, "paired": bootstrap(reports, k, base=BASE),
            "heldout": rates(drafter, target, heldout) if rates and heldout else None}


def table(result: dict) -> str:
    """The two arms side by side with the part's paired lift, as markdown."""
    paired, held = result["paired"], result["heldout"]
    k = len(paired[BASE]["alpha"])
    head = ["draft", *[f"α{j}" for j in range(1, k + 1)], "τ", "τ − backbone's (paired)", "greedy match"]
    if held:
        head += ["held-out acc per slot", "accepted per block"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in (BASE, result["part"]):
        st = paired[name]
        lift_cell = "–" if name == BASE else f"{st['diff'][k]:+.3f} ± {st['diff_se'][k]:.3f} ({st['better']} better, {st['worse']} worse)"
        cells = [name, *[pm(st["alpha"][j], st["se"][j]) for j in range(k)], pm(st["tau"], st["se"][k]), lift_cell,
                 result["reports"][name]["greedy_match"]]
        if held:
            cells += [" ".join(f"{x:.2f}" for x in held[name]["acc"]), f"{held[name]['accepted']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    n = paired[BASE]["prompts"]
    note = f"\n{n} prompts; ± one bootstrap s.e. over prompts, the lift paired (the same resampled prompts for both)."
    if held and "recall_at_k" in held:
        note += f"\nrecall@{held['top_k']} per slot on {held['blocks']} held-out blocks: " + " ".join(f"{x:.2f}" for x in held["recall_at_k"])
    return "\n".join(lines) + note + "\n"


def main(argv=None) -> int:
    import torch

    from draftlab import atomic
    from draftlab.checkpoint import load_drafter
    from draftlab.data.dataset import build_samples
    from draftlab.inference.prompts import load_prompts
    from draftlab.models.target import Target
    from draftlab.recipe import load_recipe

    p = argparse.ArgumentParser(prog="python -m draftlab.inference.lift", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="a checkpoint directory of a family with a part (dflash2, domino)")
    p.add_argument("--recipe", required=True, help="the recipe it was trained with: target, held-out split, eval spec")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides of the recipe, e.g. eval.num_prompts=32")
    p.add_argument("--report", help="write both reports, the paired statistics and the held-out rates as JSON here")
    args = p.parse_intermixed_args(argv)  # overrides after --recipe too
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        device = recipe.target.device if recipe.target.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
        target = Target.load(recipe.target.model, recipe.target.dtype, device, recipe.target.trust_remote_code)
        drafter, _ = load_drafter(args.checkpoint, target)
        arms(drafter)  # a family without a part fails before any data is read
        samples = build_samples(recipe.data, target.tokenizer)
        prompts = load_prompts(recipe.eval.data, target.tokenizer, recipe.eval.num_prompts, data_spec=recipe.data)
        result = lift(target, drafter, prompts, recipe.eval, samples.heldout, seed=recipe.seed, data=recipe.eval.data)
    except DraftlabError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    print(table(result), end="")
    if args.report:
        atomic.write_text(args.report, json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
