"""inference/paired.py: pooled α_j and τ of reports on the same prompts, paired bootstrap intervals."""

import pytest

from draftlab.errors import DraftlabError
from draftlab.inference.paired import bootstrap, pm, pooled


def rep(accepted):  # one verify step per prompt, k = 2: reached = [accepted >= 1, accepted >= 2]
    return {"prompts": [{"id": str(i), "tau": 1 + a, "num_steps": 1, "reached": [int(a >= 1), int(a >= 2)], "matched": True}
                        for i, a in enumerate(accepted)]}


def test_pooled_sums_steps_over_prompts():
    alpha, tau = pooled(rep([0, 1, 2, 1])["prompts"], 2)
    assert alpha == [0.75, 1 / 3] and tau == 2.0


def test_paired_differences_and_their_interval():
    stats = bootstrap({"base": rep([0, 1, 2, 1]), "other": rep([1, 1, 2, 2])}, k=2, base="base")
    assert stats["base"]["alpha"] == [0.75, 1 / 3] and stats["base"]["tau"] == 2.0
    assert stats["other"]["diff"][2] == pytest.approx(0.5) and (stats["other"]["better"], stats["other"]["worse"]) == (2, 0)
    assert stats["base"]["diff_se"][2] == 0.0 and stats["other"]["se"][2] > 0
    # a constant shift on every prompt: the paired difference has no spread, the arms' own τ do
    shifted = bootstrap({"base": rep([0, 1, 0, 1]), "up": rep([1, 2, 1, 2])}, k=2, base="base")["up"]
    assert shifted["diff"][2] == pytest.approx(1.0) and shifted["diff_se"][2] == pytest.approx(0.0) and shifted["se"][2] > 0.2
    assert stats["other"]["matched"] == stats["other"]["prompts"] == 4
    assert pm(float("nan"), 0.1) == "–" and pm(0.5, 0.25) == "0.500 ± 0.250"


def test_reports_on_other_prompts_are_refused():
    with pytest.raises(DraftlabError, match="other prompts"):
        bootstrap({"base": rep([0, 1]), "other": rep([0, 1, 2])}, k=2, base="base")
