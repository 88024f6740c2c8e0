"""bench.gpu_decode end to end on CPU with a tiny target: the one command a GPU session runs
first must run here too (every part, the graphed paths in replay mode, the profile of a drafter's
steps), write its JSON and say nothing failed."""

import json

from bench import gpu_decode
from draftlab.inference.shapes import Chain


def test_every_part_runs_on_cpu(tiny_target_dirs, tmp_path, capsys):
    out = tmp_path / "gpu_decode.json"
    argv = ["--target", str(tiny_target_dirs["llama"]), "--batch-sizes", "1,2", "--steps", "3", "--num-prompts", "2",
            "--max-new-tokens", "6", "--replay-graphs", "--out", str(out)]
    assert gpu_decode.main(argv) == 0, capsys.readouterr().out
    report = json.loads(out.read_text())
    assert "errors" not in report
    assert {(r["graphs"], r["loop"]) for r in report["plain"]} == {("eager", "host"), ("replay", "host"), ("replay", "device")}
    assert [d["drafter"] for d in report["drafters"]] == ["oracle k=1", "oracle k=3", "lookahead"]
    assert all(d["greedy_match"] == "2/2" for d in report["drafters"])
    assert report["host_reads_per_step"]["reference"] == {"host_reads_b1": 1.0, "host_reads_b4": 1.0}


def test_profile_of_graphed_steps_runs_on_cpu(tiny_llama):
    """The profile of graphed steps (CUDA only in the bench) runs in replay mode: a table, and no
    CUDA kernels counted on CPU."""
    from draftlab.inference.ngram import NgramProposer

    class Row:
        prompt_ids = [5, 6, 7, 5, 6, 7, 5, 6]

    table, per_step = gpu_decode.profile_steps(tiny_llama, [Row()], (NgramProposer(3, 1), Chain(2)), steps=3)
    assert "Name" in table and per_step == 0
