"""Three acceptances of one DFlash2 checkpoint: the backbone's own top-1 per slot, the selector's path,
and recall@K (how often the target's greedy token is among a slot's unary top-K: the selector
cannot pick what the top-K lacks).

The first two by real speculative decoding of the same prompts with the same decoding spec
(:func:`~draftlab.inference.evaluate.acceptance_report`, greedy output checked against plain
decoding), the drafter's proposer with its selector on and off
(:class:`~draftlab.inference.dflash2.DFlash2Proposer`); recall@K and the two drafts' per-slot
agreement with the target's greedy token on held-out samples (:func:`heldout_slots`: every block
of every held-out sample, the target's features of the data's prefix as context, as training
sees them).

    python -m draftlab.inference.dflash2_eval CHECKPOINT --recipe RECIPE [dotted.key=value ...] [--report out.json]

takes the target, the held-out split and the ``eval:`` spec from the recipe the checkpoint was
trained with.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from draftlab.inference.dflash2 import DFlash2Proposer


@torch.no_grad()
def heldout_slots(drafter, target, samples, chunk: int = 64) -> dict:
    """Per-slot rates over held-out ``samples`` (dicts with ``input_ids`` and ``loss_mask``), at
    every anchor whose next token is an assistant token, ``chunk`` blocks per forward:
    ``recall_at_k`` (the target's greedy token among the unary top-K), ``backbone_acc`` (the
    unary top-1 is it), ``selector_acc`` (the selector's greedy walk from the anchor picks it);
    ``backbone_accepted`` / ``selector_accepted``: the mean greedy-accepted prefix of each draft
    per block; ``blocks``: how many blocks were read."""
    d = drafter.eval()
    J, K = d.block_size - 1, d.candidate_selector.top_k
    hits = {k: torch.zeros(J) for k in ("recall_at_k", "backbone_acc", "selector_acc")}
    counts, streaks, blocks = torch.zeros(J), {"backbone_accepted": 0.0, "selector_accepted": 0.0}, 0
    for s in samples:
        ids = s["input_ids"].long().view(1, -1).to(target.device)
        batch = {"input_ids": ids, "loss_mask": s["loss_mask"].bool().view(1, -1).to(ids.device),
                 "attention_mask": torch.ones_like(ids)}
        hidden = target(ids, layers=d.capture_layers, logits=None).hidden
        batch.update(d.derived_targets(hidden, batch))
        with torch.random.fork_rng(devices=[]):  # every valid anchor, in an order that moves no caller's RNG
            anchors, real = d.sample_anchors(batch["loss_mask"], batch["attention_mask"], ids.shape[1])
        anchors, real = anchors[:, real[0]], real[:, real[0]]
        for a in range(0, anchors.shape[1], chunk):
            at, ok = anchors[:, a : a + chunk], real[:, a : a + chunk]
            states = d.anchored_states(ids, batch["attention_mask"], hidden, at)[0, :, 1:].contiguous()  # [A, J, H]
            logits = d.readout(states)
            t = d.block_targets(batch, at, ok)
            m, greedy = t["counted"][0], t["greedy"][0]
            top = d.to_target_ids(logits.topk(K, dim=-1).indices)
            path, _ = d.walk(states, logits, ids[0, at[0]], lambda x: x.argmax(-1))
            got = {"recall_at_k": (top == greedy[..., None]).any(-1), "backbone_acc": d.to_target_ids(logits.argmax(-1)) == greedy,
                   "selector_acc": path == greedy}
            for k, v in got.items():
                hits[k] += (v & m).sum(0).float()
            counts += m.sum(0).float()
            first = m[:, 0]
            blocks += int(first.sum())
            for k, v in (("backbone_accepted", got["backbone_acc"]), ("selector_accepted", got["selector_acc"])):
                streaks[k] += float((v & m).long().cumprod(-1).sum(-1)[first].sum())
    n = counts.clamp_min(1)
    return {**{k: (v / n).tolist() for k, v in hits.items()}, **{k: v / max(blocks, 1) for k, v in streaks.items()},
            "top_k": K, "blocks": blocks}


def acceptances(target, drafter, prompts, spec, heldout, seed: int = 0, data: str | None = None) -> dict:
    """``selector`` and ``backbone``: the acceptance reports of ``drafter`` decoding ``prompts`` by
    ``spec`` with its selector's walk and with each slot's own top-1; ``heldout``:
    :func:`heldout_slots` of the ``heldout`` samples."""
    from draftlab.inference.evaluate import acceptance_report

    eos = getattr(target.tokenizer, "eos_token_id", None)
    reports = {name: acceptance_report(target, DFlash2Proposer(drafter, selector=on), prompts, spec, seed=seed, eos_token_id=eos,
                                       data=data, label=name)
               for name, on in (("selector", True), ("backbone", False))}
    return {**reports, "heldout": heldout_slots(drafter, target, heldout)}


def table(result: dict) -> str:
    """The three acceptances side by side, as markdown."""
    h = result["heldout"]
    K = len(result["selector"]["alpha"])
    head = "| draft | tau | " + " | ".join(f"alpha_{j + 1}" for j in range(K)) + " | held-out acc per slot | accepted | greedy match |"
    lines = [head, "|" + "---|" * (K + 5)]
    for name, key in (("backbone top-1", "backbone"), ("selector path", "selector")):
        r = result[key]
        alpha = " | ".join("-" if a is None else f"{a:.3f}" for a in r["alpha"])
        acc = " ".join(f"{x:.2f}" for x in h[f"{key}_acc"])
        lines.append(f"| {name} | {r['tau']:.3f} | {alpha} | {acc} | {h[f'{key}_accepted']:.3f} | {r['greedy_match']} |")
    recall = " ".join(f"{x:.2f}" for x in h["recall_at_k"])
    lines.append(f"\nrecall@{h['top_k']} per slot on {h['blocks']} held-out blocks: {recall}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from draftlab import atomic
    from draftlab.checkpoint import load_drafter
    from draftlab.data.dataset import build_samples
    from draftlab.errors import DraftlabError
    from draftlab.inference.prompts import load_prompts
    from draftlab.models.target import Target
    from draftlab.recipe import load_recipe

    p = argparse.ArgumentParser(prog="python -m draftlab.inference.dflash2_eval", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="a dflash2 checkpoint directory")
    p.add_argument("--recipe", required=True, help="the recipe it was trained with: target, held-out split, eval spec")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides of the recipe, e.g. eval.num_prompts=4")
    p.add_argument("--report", help="write the three acceptances as JSON here")
    args = p.parse_intermixed_args(argv)  # overrides after --recipe too
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        device = recipe.target.device if recipe.target.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
        target = Target.load(recipe.target.model, recipe.target.dtype, device, recipe.target.trust_remote_code)
        drafter, meta = load_drafter(args.checkpoint, target)
        if meta["algorithm"] != "dflash2":
            raise DraftlabError(f"{args.checkpoint}: a {meta['algorithm']} checkpoint, not dflash2")
        samples = build_samples(recipe.data, target.tokenizer)
        prompts = load_prompts(recipe.eval.data, target.tokenizer, recipe.eval.num_prompts, data_spec=recipe.data)
        result = acceptances(target, drafter, prompts, recipe.eval, samples.heldout, seed=recipe.seed, data=recipe.eval.data)
    except DraftlabError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    print(table(result), end="")
    if args.report:
        atomic.write_text(args.report, json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
