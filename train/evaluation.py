"""Acceptance evaluation after every checkpoint: real speculative decoding on held-out prompts,
through the same ``inference.evaluate`` that ``draftlab eval`` uses. Each report is written
to ``<run>/eval/step-N.json`` (+ .md, .png) and ``<run>/eval/latest.*``, whose plot carries
one alpha_j curve per checkpoint so far."""

from __future__ import annotations

from pathlib import Path


class CheckpointEvaluator:
    def __init__(self, recipe, target, samples, drafter=None):
        from draftlab.inference.prompts import load_prompts

        from draftlab.inference.proposer import PROPOSERS, check_shape

        from draftlab.errors import DraftlabError

        self.recipe, self.target = recipe, target
        self.dir = Path(recipe.output_dir) / "eval"
        e = recipe.eval
        if e.cuda_graphs and target.device.type != "cuda":
            raise DraftlabError(f"eval.cuda_graphs: CUDA graphs need the target on a CUDA device, not {target.device}")
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
        from draftlab.inference.evaluate import evaluate
        from draftlab.inference.proposer import load_proposer
        from draftlab.checkpoint import read_meta
        from draftlab.inference.report import markdown, write_report

        e = self.recipe.eval
        step = int(Path(checkpoint_dir).name.split("-")[-1])
        proposer = load_proposer(checkpoint_dir, self.target)
        report = evaluate(
            self.target,
            proposer,
            self.prompts,
            shape=e.shape(),
            max_new_tokens=e.max_new_tokens,
            temperature=e.temperature,
            seed=self.recipe.seed,
            eos_token_id=self.target.tokenizer.eos_token_id,
            baseline=e.baseline,
            data=e.data,
            label=f"step {step}",
            cuda_graphs=e.cuda_graphs,
        )
        if e.batch_sizes:
            from draftlab.inference.batch_eval import evaluate_batches

            report["batches"] = evaluate_batches(
                self.target, proposer, self.prompts, e.shape(), e.batch_sizes,
                max_new_tokens=e.max_new_tokens, temperature=e.temperature, seed=self.recipe.seed,
                eos_token_id=self.target.tokenizer.eos_token_id, adaptive=e.adaptive, cuda_graphs=e.cuda_graphs,
            )
        report["step"] = step
        report["checkpoint"] = str(checkpoint_dir)
        # training's per-position accuracy beside the served acceptance: a gap between them is
        # a train/serve mismatch that must not go unseen (inference/report.py train_serve_gap)
        acc = (read_meta(checkpoint_dir).get("metrics") or {}).get("acc")
        if isinstance(acc, list) and acc:
            report["train_acc"] = acc
        history = [r for r in self.history() if r.get("step") != step]
        write_report(report, self.dir / f"step-{step:07d}.json", history=history)
        write_report(report, self.dir / "latest.json", history=history)
        print(f"\neval @ step {step} ({e.data}, {len(self.prompts)} prompts, {e.method}):\n{markdown(report)}", flush=True)
        return report
