"""The oracle drafter (``--drafter oracle``): it drafts the target's own greedy continuation, so
every draft is accepted (τ = k + 1) and its speedup is the engine's ceiling at that k."""

from __future__ import annotations

import json

import pytest

from draftlab.errors import DraftlabError
from draftlab.inference.decoder import Decoder, generate_plain_batch
from draftlab.inference.oracle import OracleProposer
from draftlab.inference.proposer import FREE_DRAFTERS
from draftlab.inference.shapes import Chain
from tiny import assert_one_line

TEXTS = ["The quick brown fox jumps", "a b c a b c a b", "Speculative decoding drafts tokens and the target verifies them"]
N_NEW = 24

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("k", [1, 3])
def test_every_draft_is_accepted(tiny_llama, prompts, alone, k):
    for prepared in (True, False):  # prepared by the harness, or decoded at its start
        oracle = OracleProposer(tiny_llama)
        if prepared:
            oracle.prepare(tiny_llama, prompts, N_NEW)
        for p, want in zip(prompts, alone):
            row = Decoder(tiny_llama, oracle).generate([p], N_NEW, Chain(k)).rows[0]
            assert row.tokens == want
            # every step accepts all k drafts but the last, which the token budget may cut short
            assert row.accept_lengths[:-1] == [k] * (len(row.accept_lengths) - 1)
            assert len(row.accept_lengths) == -(-(N_NEW - 1) // (k + 1))


def test_a_row_off_its_continuation_drafts_nothing_and_stays_lossless(tiny_llama, prompts):
    oracle = OracleProposer(tiny_llama)
    oracle.prepare(tiny_llama, prompts, N_NEW)
    key = tuple(prompts[0])
    truth = oracle._continuations[key]
    oracle._continuations[key] = truth[:3] + [(t + 1) % tiny_llama.vocab_size for t in truth[3:]]  # wrong after 3
    res = Decoder(tiny_llama, oracle).generate(prompts, N_NEW, Chain(2))
    assert [r.tokens for r in res.rows] == [r.tokens for r in generate_plain_batch(tiny_llama, prompts, N_NEW).rows]
    first = res.rows[0].accept_lengths
    assert first[0] == 2 and set(first[1:]) == {0}  # two right drafts, then a bonus off the wrong tail: nothing more


def test_options_and_cli(tiny_target_dirs, tmp_path, capsys):
    from draftlab.cli import main

    assert FREE_DRAFTERS.get("oracle") is OracleProposer
    for options, message in [({"max_new_tokens": "0"}, "max_new_tokens must be a positive integer, got 0"),
                             ({"max_new_tokens": "many"}, "max_new_tokens must be an integer, got 'many'"),
                             ({"depth": "3"}, "unknown option 'depth'")]:
        with pytest.raises(DraftlabError) as e:
            OracleProposer.from_options(options)(None)
        assert_one_line(e, message)
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"category": "chat", "turns": [t]}) + "\n" for t in TEXTS[:2]))
    out = tmp_path / "rep" / "eval.json"
    argv = ["eval", "--drafter", "oracle", "--target", str(tiny_target_dirs["llama"]), "--data", str(data), "--num-prompts", "2",
            "--max-new-tokens", "9", "--k", "3", "--report", str(out)]
    assert main(argv) == 0
    rep = json.loads(out.read_text())
    assert rep["greedy_match"] == "2/2" and rep["label"] == "oracle" and rep["tau"] == 4.0  # 8 tokens after the first: 2 steps of 4
    capsys.readouterr()
    assert main(argv[:-2] + ["--method", "tree"]) == 2
    assert "does not draft" in capsys.readouterr().err


def test_every_greedy_chain_report_gives_the_engine_ceiling(tiny_llama, prompts):
    """A drafter's report carries the oracle's run at the same k beside it (tau = k + 1); not
    beside the oracle itself, nor for trees or sampled decoding."""
    from draftlab.inference.evaluate import evaluate
    from draftlab.inference.lookahead import LookaheadProposer
    from draftlab.inference.ngram import NgramProposer
    from draftlab.inference.prompts import EvalPrompt
    from draftlab.inference.report import markdown
    from draftlab.inference.shapes import DynamicTree

    ps = [EvalPrompt(id=str(i), category="c", prompt_ids=p) for i, p in enumerate(prompts[:2])]
    rep = evaluate(tiny_llama, NgramProposer(), ps, Chain(3), max_new_tokens=13, warmup=False)
    top = rep["engine_ceiling"]
    assert top["k"] == 3 and top["tau"] == 4.0 and top["greedy_match"] == "2/2" and top["speedup"] > 0
    assert "engine ceiling (the oracle drafter: the target's own continuation, k=3): tau 4.00" in markdown(rep)
    assert "engine_ceiling" not in evaluate(tiny_llama, NgramProposer(), ps, Chain(3), max_new_tokens=5, warmup=False,
                                            temperature=1.0)
    assert "engine_ceiling" not in evaluate(tiny_llama, LookaheadProposer(), ps, DynamicTree(2, 2, 4), max_new_tokens=5,
                                            warmup=False)
    assert "engine_ceiling" not in evaluate(tiny_llama, OracleProposer(tiny_llama), ps, Chain(2), max_new_tokens=5, warmup=False)
