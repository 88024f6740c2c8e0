"""bench.families and bench.batch without models: the runs' own files, tables and one-line errors."""

import json

import pytest

from bench import batch as batch_bench
from bench import families
from bench import kernels as kernels_bench


def _run(tmp_path, reports=True):
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    records = [{"step": 1, "loss": 1.0, "elapsed_s": 30.0}, {"step": 2, "loss": 0.9, "elapsed_s": 60.0},
               {"step": 2, "eval_tau": 1.2, "eval_alpha": [0.2]}, {"step": 4, "loss": 0.8, "elapsed_s": 150.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if reports:
        for step, a in ((2, 0.2), (4, 0.3)):
            rep = {"step": step, "tau": 1 + a, "alpha": [a], "speedup": 1.0, "greedy_match": "2/2", "method": "chain",
                   "k": 1, "num_prompts": 2, "max_new_tokens": 12, "data": "sharegpt-heldout"}
            (run / "eval" / f"step-{step:07d}.json").write_text(json.dumps(rep))
        (run / "eval" / "latest.json").write_text("{}")
    return run


def test_curve_pairs_reports_with_training_minutes(tmp_path):
    run = _run(tmp_path)
    curve = families.acceptance_curve(run, families.elapsed_by_step(run))
    assert [(p["step"], p["train_min"], p["alpha1"]) for p in curve] == [(2, 1.0, 0.2), (4, 2.5, 0.3)]
    assert "chain k=1" in families.curve_table([{"algorithm": "eagle3", "name": "run", "curve": curve}])


@pytest.mark.parametrize("what, message", [("missing", "no such run directory"), ("no-reports", "no eval/step-"),
                                           ("no-checkpoint", "no checkpoint")])
def test_one_line_errors(tmp_path, capsys, what, message):
    run = tmp_path / "nope" if what == "missing" else _run(tmp_path, reports=what != "no-reports")
    assert families.main([str(run), "--quick"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench.families: error:") and message in err and "\n" not in err


def test_results_table_gives_the_draft_time_per_verify_step():
    run = {"step": 4, "train_min": 2.5}
    agree = {"top1": [0.5], "top5": None}
    rep = {"num_prompts": 2, "tau": 1.5, "tau_se": 0.1, "alpha": [0.5], "speedup": 0.9, "greedy_match": "2/2",
           "draft_time_s": 0.3, "num_steps": 20}
    rows = [{"label": "eagle3 a", "run": run, "agree": agree, "data": "sharegpt-heldout", "shape": "chain k=1", "report": rep},
            {"label": "eagle3 a", "run": run, "agree": agree, "data": "spec-bench", "shape": "chain k=1", "skipped": "not found"}]
    lines = families.results_table(rows).splitlines()
    assert len({line.count("|") for line in lines}) == 1  # every row has the header's columns
    assert "| 1.50 ± 0.10 | 0.50 | 15.0 | 0.90× | 2/2 |" in lines[2]


def test_a_checkpoint_measures_its_run_at_that_step(tmp_path):
    """A run's checkpoint stands for the run at that step (equal minutes with a shorter run): its
    minutes are the trainer's at that step, its curve the whole run's, its name run@step."""
    run = _run(tmp_path)
    for step in (2, 4):
        ckpt = run / "checkpoints" / f"step-{step:07d}"
        ckpt.mkdir(parents=True)
        meta = {"format": "draftlab-checkpoint/1", "algorithm": "eagle3", "drafter": {}, "target": {}, "step": step,
                "recipe": {"algorithm": "eagle3", "output_dir": str(run)}}
        (ckpt / "draftlab.json").write_text(json.dumps(meta))
    whole, early = families.load_run(str(run)), families.load_run(str(run / "checkpoints" / "step-0000002"))
    assert (whole["name"], whole["step"], whole["train_min"]) == ("run", 4, 2.5)
    assert (early["name"], early["step"], early["train_min"]) == ("run@2", 2, 1.0)
    assert early["curve"] == whole["curve"] and early["run"] == whole["run"]


def test_paired_table_differences_runs_on_the_same_prompts():
    def rep(accepted):  # one verify step per prompt, k = 2
        return {"prompts": [{"id": str(i), "tau": 1 + a, "num_steps": 1, "reached": [int(a >= 1), int(a >= 2)]}
                            for i, a in enumerate(accepted)]}

    def row(name, shape, accepted):
        return {"run": {"name": name}, "data": "sharegpt-heldout", "shape": shape, "report": rep(accepted)}

    rows = [row("base", "chain k=2", [0, 1, 1, 0]), row("new", "chain k=2", [1, 2, 2, 1]), row("new", "tree", [2, 2, 2, 2]),
            {"run": {"name": "base"}, "data": "spec-bench", "shape": "chain k=2", "skipped": "not found"}]
    lines = families.paired_table(rows, [("new", "base")]).splitlines()
    assert len(lines) == 3  # the tree has no base row to pair with
    assert lines[2].startswith("| new − base | sharegpt-heldout | chain k=2 | ")
    assert "| 1.000 ± 0.000 | 4 / 0 |" in lines[2]  # one more token on every prompt: no spread
    with pytest.raises(families.DraftlabError, match="--pair new: expected RUN=BASE"):
        families.pair_arg("new", ["new", "base"])
    with pytest.raises(families.DraftlabError, match="two different run directory names"):
        families.pair_arg("new=other", ["new", "base"])
    assert families.pair_arg("new=base", ["new", "base"]) == ("new", "base")


def test_same_tree_gives_static_tree_families_the_static_tree():
    """Hydra++ drafts dynamic and static trees, Medusa static ones: --same-tree decodes both at
    --static-tree; without it Hydra++ decodes its recipe's dynamic tree."""
    from types import SimpleNamespace

    from draftlab.recipe import load_recipe

    r = {"recipe": load_recipe(families.REPO / "recipes" / "smollm2-135m-hydra.yaml"), "algorithm": "hydra"}
    tree = families.static_tree_arg(families.DEFAULT_STATIC_TREE)
    hydra = SimpleNamespace(shapes=frozenset({"chain", "static_tree", "dynamic_tree"}))
    medusa = SimpleNamespace(shapes=frozenset({"chain", "static_tree"}))
    eagle_chain_only = SimpleNamespace(shapes=frozenset({"chain", "dynamic_tree"}))
    names = lambda p, same: [n for n, _, _ in families.shapes_for(r, p, tree, same)]  # noqa: E731
    assert names(hydra, False)[1].startswith("tree d") and names(hydra, True)[1] == "static tree [[0],[1],[0,0],[0,0,0]]"
    assert names(medusa, False) == names(medusa, True) == ["chain k=4", "static tree [[0],[1],[0,0],[0,0,0]]"]
    assert names(eagle_chain_only, True)[1].startswith("tree d")  # no static tree to share: its own


@pytest.mark.parametrize("bench, prog", [(batch_bench, "bench.batch"), (kernels_bench, "bench.kernels")])
def test_bad_draft_lengths_are_one_line_errors(capsys, bench, prog):
    """A bad list flag is a one-line error (raised while parsing, before any model loads)."""
    assert bench.main(["--ks", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{prog}: error: --ks:") and "\n" not in err


def test_batch_tables_summarise_adaptive_with_paired_intervals():
    def entry(b, speedup, base, groups=2):
        # groups of 10 tokens: plain at ``base`` tok/s, the configuration at ``speedup`` times that
        return {"batch_size": b, "speedup": speedup, "tokens_per_s": speedup * base, "baseline_tokens_per_s": base,
                "speedup_interval": [speedup - 0.05, speedup + 0.05],
                "groups": [[10, 10 / (speedup * base), 10, 10 / base]] * groups,
                "tau": 1.3, "decode_time_s": 1.0, "draft_s": 0.1, "verify_s": 0.8, "other_s": 0.1,
                "greedy_match": "4/4", "batched_vs_alone": "4/4"}

    results = {"ngram k=3": {"entries": [entry(1, 1.2, 20.0), entry(4, 0.7, 60.0)]},
               "eagle3 k=1": {"entries": [entry(1, 1.1, 20.0), entry(4, 0.8, 60.0)]},
               "eagle3 k=2": {"entries": [entry(1, 1.15, 20.0), entry(4, 0.6, 60.0)]},
               "eagle3 adaptive k<=2": {"entries": [dict(entry(1, 1.161, 20.0), draft_lengths={"2": 9}),
                                                    dict(entry(4, 0.96, 60.0), draft_lengths={"0": 30})]}}
    text = batch_bench.tables(results, [1, 4])
    assert "| eagle3 adaptive k<=2 | 1.16× (1.11-1.21) | 0.96× (0.91-1.01) |" in text
    # to 3 decimals; a tie is told apart from a loss: the interval holds 1.000 and the policy never drafted there
    assert ("Adaptive against plain decoding, to 3 decimals (90 % interval): B=1 1.161 (1.111-1.211); "
            "B=4 0.960 (0.910-1.010, no drafting step): below 1.000 at B = 4 (the 90 % interval holds 1.000 at B = 4).") in text
    assert "B=1: 1.16× vs best fixed k=2 1.15× (adaptive / best fixed 1.010, 90 % interval 1.010-1.010)" in text
    assert "B=4: 0.96× vs best fixed k=1 0.80× (adaptive / best fixed 1.200, 90 % interval 1.200-1.200)" in text
    # more groups of the adaptive policy alone: its margin over fixed k is paired on the groups both decoded
    pooled = results["eagle3 adaptive k<=2"]["entries"][1]
    pooled["groups"] += [[10, 10 / 60.0, 10, 10 / 60.0]] * 6
    pooled["speedup"] = 8 / (2 / 0.96 + 6)  # over all 8 groups
    assert "(adaptive / best fixed 1.200, 90 % interval 1.200-1.200)" in batch_bench.tables(results, [1, 4], 6)
