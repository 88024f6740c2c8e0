"""Acceptance evaluation after every checkpoint: real speculative decoding on held-out prompts,
through the same harness that ``draftlab eval`` uses
(:func:`~draftlab.inference.evaluate.acceptance_report`), with the recipe's ``eval:`` spec.
Each report is written to ``<run>/eval/step-N.json`` (+ .md, .png) and ``<run>/eval/latest.*``,
whose plot carries one alpha_j curve per checkpoint so far. :func:`report_checkpoint` and
:func:`write_checkpoint_report` serve the trainer and the layer-skip search alike."""

from __future__ import annotations

from pathlib import Path


def report_checkpoint(recipe, target, prompts, proposer, checkpoint_dir, step: int, spec=None, label: str | None = None) -> dict:
    """The report of ``proposer`` (loaded from ``checkpoint_dir``, or built for it) decoding
    ``prompts`` by ``spec`` (default the recipe's ``eval:``), with its step and checkpoint, and
    training's per-position accuracy beside the served acceptance: a gap between them is a
    train/serve mismatch that must not go unseen (inference/report.py train_serve_gap)."""
    from draftlab.checkpoint import read_meta
    from draftlab.inference.evaluate import acceptance_report

    report = acceptance_report(target, proposer, prompts, spec or recipe.eval, seed=recipe.seed,
                               eos_token_id=target.tokenizer.eos_token_id, data=recipe.eval.data,
                               label=label or f"step {step}")
    report["step"], report["checkpoint"] = step, str(checkpoint_dir)
    acc = (read_meta(checkpoint_dir).get("metrics") or {}).get("acc")
    if isinstance(acc, list) and acc:
        report["train_acc"] = acc
    return report


def write_checkpoint_report(recipe, report: dict, history: list[dict], note: str = "") -> None:
    """``report`` as ``<run>/eval/step-N.*`` and ``latest.*`` (``history``: the other reports its
    plot carries), and its table printed (``note``: more to print after it)."""
    from draftlab.inference.report import markdown, write_report

    out, e = Path(recipe.output_dir) / "eval", recipe.eval
    write_report(report, out / f"step-{report['step']:07d}.json", history=history)
    write_report(report, out / "latest.json", history=history)
    print(f"\neval @ step {report['step']} ({e.data}, {len(report['prompts'])} prompts, {e.method}):\n{markdown(report)}{note}",
          flush=True)


class CheckpointEvaluator:
    def __init__(self, recipe, target, samples, drafter=None):
        from draftlab.inference.decoding_spec import check_spec, field_names
        from draftlab.inference.prompts import load_prompts
        from draftlab.inference.proposer import PROPOSERS
        from draftlab.inference.shapes import check_shape

        self.recipe, self.target = recipe, target
        self.dir = Path(recipe.output_dir) / "eval"
        e = recipe.eval
        check_spec(e, field_names("eval."), seed=recipe.seed, device=target.device)  # now that the device is known
        # a shape the family cannot draft fails now, not after the first checkpoint
        proposer = PROPOSERS.get(recipe.algorithm, "algorithm")
        check_shape(e.shape(), proposer.shapes, recipe.algorithm)
        if drafter is not None:
            proposer.check(e.shape(), drafter)
        self.prompts = load_prompts(e.data, target.tokenizer, e.num_prompts, data_spec=recipe.data)

    def history(self) -> list[dict]:
        """The earlier checkpoints' reports (one that cannot be read is left out of the plot, with a warning)."""
        from draftlab.checkpoint import read_json
        from draftlab.errors import DraftlabError

        if not self.dir.is_dir():
            return []
        reports = []
        for p in sorted(self.dir.glob("step-*.json")):
            try:
                report = read_json(p)
            except (DraftlabError, OSError) as e:
                print(f"eval: an earlier report is left out of the plot: {e}", flush=True)
                continue
            if isinstance(report.get("step", 0), int):
                reports.append(report)
        return sorted(reports, key=lambda r: r.get("step", 0))

    def __call__(self, checkpoint_dir: Path) -> dict:
        from draftlab.inference.proposer import load_proposer

        step = int(Path(checkpoint_dir).name.split("-")[-1])
        report = report_checkpoint(self.recipe, self.target, self.prompts, load_proposer(checkpoint_dir, self.target),
                                   checkpoint_dir, step)
        write_checkpoint_report(self.recipe, report, [r for r in self.history() if r.get("step") != step])
        return report
