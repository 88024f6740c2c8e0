"""Decoding forwards replayed from captured graphs (inference/graphs.py), on CPU in the "replay"
mode, which runs a captured forward again from its buffers: the static KV cache gives the
ragged cache's logits; decoding through a GraphedTarget gives the tokens decoding through the
target does, for plain, chain, tree, layer-skip (the target drafts over the cache), lookahead
(branch inputs) and draft-LM (its own forwards graphed too) steps and rows finishing early; graphs are reused across decodings; shapes past
the limits run eagerly and are counted. The same on CUDA with real graphs: test_cuda.py."""

from __future__ import annotations

import pytest
import torch

from draftlab.errors import DraftlabError
from draftlab.inference.decoder import Decoder, generate_plain_batch, run_lockstep
from draftlab.inference.graphs import GraphedTarget
from draftlab.inference.layerskip import LayerSkipProposer
from draftlab.inference.lookahead import LookaheadProposer
from draftlab.inference.ngram import NgramProposer
from draftlab.inference.proposer import OwnModel
from draftlab.inference.shapes import Chain, DynamicTree
from draftlab.inference.report import graphs_line
from draftlab.models.layerskip import LayerSkip
from tiny import assert_one_line

TEXTS = ["The quick brown fox jumps", "Speculative decoding drafts tokens and the target verifies them all at once",
         "a b c a b c a b"]
N_NEW = 24

pytestmark = pytest.mark.usefixtures("one_thread")


def _prefilled(target, prompts, static: bool):
    cache = target.new_cache(len(prompts), 96, ragged=True, static=static)
    for s, p in enumerate(prompts):
        target(torch.tensor([p]), cache=cache.row(s), logits=None)
        cache.lengths[s] = len(p)
    return cache


def test_static_cache_forward_equals_ragged(tiny_llama, prompts):
    """Rows of different lengths; a causal chain, a tree mask with depth offsets, and a mask over
    each row's past and new slots (a tree grown in the cache): same logits and hidden states."""
    t = tiny_llama
    caches = [_prefilled(t, prompts, static) for static in (False, True)]
    B = len(prompts)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)[None].repeat(B, 1, 1)
    depth = torch.tensor([[0, 1, 1]]).repeat(B, 1)
    steps = [dict(input_ids=torch.randint(0, 300, (B, 4), generator=torch.Generator().manual_seed(0))),
             dict(input_ids=torch.tensor([[5, 6, 7]] * B), position_ids=depth, attn_mask=tree)]
    outs = [[t(**kw, cache=c, layers=[2, t.num_layers]) for kw in steps] for c in caches]
    span = max(caches[0].lengths) + 2
    grown = torch.ones(B, 2, span, dtype=torch.bool)
    grown[0, :, caches[0].lengths[0] - 1] = False  # row 0 hides its last drafted slot
    outs[0].append(t(torch.tensor([[9, 10]] * B), cache=caches[0], attn_mask=grown))
    outs[1].append(t(torch.tensor([[9, 10]] * B), cache=caches[1], attn_mask=grown))
    for ragged, static in zip(*outs):
        torch.testing.assert_close(static.logits, ragged.logits, atol=1e-5, rtol=1e-5)
        for i in ragged.hidden:
            torch.testing.assert_close(static.hidden[i], ragged.hidden[i], atol=1e-5, rtol=1e-5)
    assert caches[0].lengths == caches[1].lengths


def _draft_lm(t):
    from draftlab.inference.draft_lm import DraftLMProposer
    from draftlab.models.draft_lm import DraftLM, DraftLMConfig

    torch.manual_seed(0)
    return DraftLMProposer(DraftLM.build(DraftLMConfig(num_layers=2), t))


CASES = {
    "draft lm chain": (_draft_lm, Chain(3)),
    "draft lm tree": (_draft_lm, DynamicTree(3, 2, 8)),
    "ngram chain": (lambda t: NgramProposer(3, 1), Chain(3)),
    "ngram tree": (lambda t: NgramProposer(3, 1), DynamicTree(3, 2, 8)),
    "layer skip chain": (lambda t: LayerSkipProposer(LayerSkip([2], t.num_layers, True)), Chain(3)),
    "layer skip tree": (lambda t: LayerSkipProposer(LayerSkip([2], t.num_layers, True)), DynamicTree(3, 2, 8)),
    "lookahead": (lambda t: LookaheadProposer(W=3, N=3, G=3), Chain(3)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_decoding_through_graphs_gives_the_targets_tokens(tiny_llama, prompts, case):
    build, shape = CASES[case]
    graphed = GraphedTarget(tiny_llama, mode="replay")
    eager = Decoder(tiny_llama, build(tiny_llama)).generate(prompts, N_NEW, shape)
    proposer, drafter = build(tiny_llama), []
    if isinstance(proposer, OwnModel):
        proposer.use_graphs(lambda model: drafter.append(GraphedTarget(model, mode="replay")) or drafter[-1])
    res = Decoder(graphed, proposer).generate(prompts, N_NEW, shape)
    assert [r.tokens for r in res.rows] == [r.tokens for r in eager.rows]
    assert [r.accept_lengths for r in res.rows] == [r.accept_lengths for r in eager.rows]
    for g in [graphed, *drafter]:  # the draft LM's own forwards too
        assert g.stats["replayed"] > g.stats["captured"] > 0 and not any(k.startswith("eager") for k in g.stats)
    assert len(drafter) == case.startswith("draft lm")


def test_graphs_are_reused_and_finished_rows_leave(tiny_llama, prompts, alone):
    """Plain decoding twice through one GraphedTarget: the second decoding captures nothing new.
    Then an eos that only row 1 emits: it idles, the batch narrows to the other rows (a view of
    the same buffer: graphs of two rows), and every row keeps its tokens."""
    graphed = GraphedTarget(tiny_llama, mode="replay")
    plain = [r.tokens for r in generate_plain_batch(tiny_llama, prompts, N_NEW).rows]
    for _ in range(2):
        assert [r.tokens for r in generate_plain_batch(graphed, prompts, N_NEW).rows] == plain
    assert graphed.stats["captured"] == 1 and graphed.stats["buffers"] == 1
    eos = alone[1][5]
    assert eos not in alone[0] + alone[2]
    four = prompts + [prompts[1]]
    res = Decoder(graphed, NgramProposer(3, 1)).generate(four, N_NEW, Chain(3), eos_token_id=eos)
    assert [r.tokens for r in res.rows] == [alone[0], alone[1][:6], alone[2], alone[1][:6]]
    assert graphed.stats["buffers"] == 2  # four rows: a larger buffer, graphs captured again
    live = {buf.k.data_ptr() for buf, _ in graphed._buffers}
    assert all(key[0] in live for key in graphed._graphs), "a graph of a dropped buffer is kept"


def test_shapes_past_the_limits_run_eagerly_and_are_counted(tiny_llama, prompts):
    plain = Decoder(tiny_llama, NgramProposer(3, 1)).generate(prompts, N_NEW, Chain(3))
    narrow = GraphedTarget(tiny_llama, mode="replay", max_inputs=1)
    res = Decoder(narrow, NgramProposer(3, 1)).generate(prompts, N_NEW, Chain(3))
    assert [r.tokens for r in res.rows] == [r.tokens for r in plain.rows]
    assert narrow.stats["eager: wider than max_inputs"] > 0 and narrow.report()["caches"] == [[len(prompts), 1024]]
    none = GraphedTarget(tiny_llama, mode="replay", max_graphs=0)
    res = Decoder(none, NgramProposer(3, 1)).generate(prompts, N_NEW, Chain(3))
    assert [r.tokens for r in res.rows] == [r.tokens for r in plain.rows]
    assert none.stats["eager: past max_graphs"] == res.num_steps and "replayed" not in none.stats


def test_cuda_graphs_on_cpu_are_a_one_line_error(tiny_llama, tiny_target_dirs, capsys):
    from draftlab.cli import main

    with pytest.raises(DraftlabError) as e:
        GraphedTarget(tiny_llama)
    assert_one_line(e, "CUDA graphs need the target on a CUDA device")
    code = main(["eval", "--drafter", "ngram", "--target", str(tiny_target_dirs["llama"]), "--device", "cpu",
                 "--num-prompts", "1", "--max-new-tokens", "4", "--cuda-graphs"])
    err = capsys.readouterr().err
    assert code != 0 and "--cuda-graphs" in err and len(err.strip().splitlines()) == 1


def test_a_shape_whose_capture_fails_runs_eagerly_once_and_for_all(tiny_llama, prompts, monkeypatch):
    """A capture that raises (an op that waits on the host) leaves that shape eager, with the
    reason counted, and is not tried again."""
    plain = generate_plain_batch(tiny_llama, prompts, N_NEW)
    graphed = GraphedTarget(tiny_llama, mode="replay")
    tries = []

    def refuse(*a, **k):
        tries.append(1)
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(graphed, "_capture", refuse)
    monkeypatch.setattr(graphed, "_capture_prefill", refuse)
    res = generate_plain_batch(graphed, prompts, N_NEW)
    assert [r.tokens for r in res.rows] == [r.tokens for r in plain.rows] and len(tries) == 2  # a step, a prefill width
    why = "capture failed (operation not permitted when stream is capturing)"
    assert graphed.stats[f"eager: {why}"] == res.num_steps and graphed.stats[f"eager prefill: {why}"] == len(prompts)
    assert ("target: 0 forwards replayed from 0 captured shapes, 0 prefills from 0 captured widths, eager: "
            f"{res.num_steps} {why}, {len(prompts)} prefills {why}") in graphs_line({"target": graphed.report()})


def test_prefills_replay_padded_graphs(tiny_llama):
    """A prompt's prefill replays the graph of its width (a power of two, at least PREFILL_MIN):
    the K/V of its slots, its last logits and hidden states are the eager prefill's; a width is
    captured once for each set of layers, ``capture_prefills`` captures them ahead, and a prompt
    past ``max_prefill`` is left to the caller (None) and counted."""
    from draftlab.inference.graphs import PREFILL_MIN

    graphed = GraphedTarget(tiny_llama, mode="replay", max_prefill=64)
    layers = (0, 2, tiny_llama.num_layers)
    graphed.capture_prefills([5, 33, 40], [(), layers])
    assert graphed.stats["prefill widths captured"] == 4 and sorted(graphed._prefills) == [
        (PREFILL_MIN, ()), (PREFILL_MIN, layers), (64, ()), (64, layers)]
    torch.manual_seed(0)
    for n in (1, 5, PREFILL_MIN, PREFILL_MIN + 1, 64):
        prompt = torch.randint(0, tiny_llama.vocab_size, (n,))
        cache = tiny_llama.new_cache(1, n)
        eager = tiny_llama(prompt[None], layers=list(layers), cache=cache, logits="last")
        done = graphed.prefill_prompt(prompt, layers)
        torch.testing.assert_close(done.k, cache.k[:, 0, :, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(done.v, cache.v[:, 0, :, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(done.logits, eager.logits[0, -1], atol=1e-4, rtol=1e-4)
        assert done.hidden.keys() == set(layers)
        for i in layers:
            torch.testing.assert_close(done.hidden[i], eager.hidden[i], atol=1e-4, rtol=1e-4)
    assert graphed.stats["prefill widths captured"] == 4 and graphed.stats["prefills replayed"] == 5
    assert graphed.prefill_prompt(torch.zeros(65, dtype=torch.long), ()) is None
    assert graphed.stats["eager prefill: longer than max_prefill"] == 1
    positions = tiny_llama.config.max_position_embeddings  # a prompt whose padding would pass them: eager
    wide = GraphedTarget(tiny_llama, mode="replay", max_prefill=4 * positions)
    assert wide.prefill_prompt(torch.zeros(positions // 2 + 1, dtype=torch.long), ()) is not None
    assert wide.prefill_prompt(torch.zeros(positions + 1, dtype=torch.long), ()) is None
    assert wide.stats["eager prefill: padded past the target's positions"] == 1


def test_decodings_in_lockstep_hold_buffers_of_their_own(tiny_llama, prompts):
    """Plain and speculative decoding stepped in turn through one GraphedTarget (what the
    evaluation harness does) each get a buffer; once they are done, a later decoding reuses one."""
    graphed = GraphedTarget(tiny_llama, mode="replay")
    eager = [Decoder(tiny_llama, NgramProposer(3, 1)).generate(prompts, N_NEW, Chain(3)), generate_plain_batch(tiny_llama, prompts, N_NEW)]
    done = run_lockstep([Decoder(graphed, NgramProposer(3, 1)).steps(prompts, N_NEW, Chain(3)), Decoder(graphed).steps(prompts, N_NEW, None)])
    assert [[r.tokens for r in d.rows] for d in done] == [[r.tokens for r in d.rows] for d in eager]
    assert len(graphed.report()["caches"]) == 2
    generate_plain_batch(graphed, prompts, N_NEW)
    assert len(graphed.report()["caches"]) == 2 and graphed.stats["buffers"] == 2


def test_evaluate_with_cuda_graphs_reports_what_replayed(tiny_llama, prompts, monkeypatch):
    """evaluate(cuda_graphs=True) with a draft LM: the target's and the draft's forwards replay
    (here in replay mode), the report counts both, and its table says so."""
    from draftlab.inference import graphs
    from draftlab.inference.evaluate import evaluate
    from draftlab.inference.prompts import EvalPrompt
    from draftlab.inference.report import markdown_table

    class Replaying(GraphedTarget):
        def __init__(self, model):
            super().__init__(model, mode="replay")

    monkeypatch.setattr(graphs, "GraphedTarget", Replaying)
    eval_prompts = [EvalPrompt(id=str(i), category="c", prompt_ids=p) for i, p in enumerate(prompts)]
    report = evaluate(tiny_llama, _draft_lm(tiny_llama), eval_prompts, Chain(2), max_new_tokens=8, cuda_graphs=True)
    g = report["cuda_graphs"]
    assert g.keys() == {"target", "drafter"} and all(g[m]["replayed"] > 0 for m in g)
    assert report["greedy_match"] == f"{len(prompts)}/{len(prompts)}"
    assert "CUDA graphs: target: " in markdown_table(report)


def test_eval_cuda_graphs_on_cpu_is_a_one_line_error_before_training(tiny_target_dirs, tmp_path, capsys):
    import yaml

    from draftlab.cli import main
    from tiny import write_chat

    recipe = {"algorithm": "draft_lm", "output_dir": str(tmp_path / "run"), "target": {"model": str(tiny_target_dirs["llama"])},
              "data": {"source": str(write_chat(tmp_path / "chat.jsonl", 8)), "max_length": 64, "heldout": 2},
              "drafter": {"num_layers": 1}, "capture": {"mode": "online"}, "train": {"max_steps": 1, "batch_tokens": 256},
              "eval": {"num_prompts": 1, "max_new_tokens": 4, "method": "chain", "k": 1, "cuda_graphs": True}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["train", str(path)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert "eval.cuda_graphs: CUDA graphs need the target on a CUDA device" in err[-1] and "Traceback" not in "\n".join(err)
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("B", [1, 16])
def test_a_plain_step_reads_the_device_once(tiny_llama, prompts, B):
    """Plain decoding reads one value set back per step (its tokens), whatever the batch size:
    counted as the host reads of device tensors (``item``, ``tolist``, ``cpu``, truth tests ...)
    over two decodings whose lengths differ by 8 steps, the prefill's reads cancelling."""
    from bench.gpu_decode import count_host_reads

    rows = [prompts[i % len(prompts)] for i in range(B)]
    graphed = GraphedTarget(tiny_llama, mode="replay")
    reads = []
    for n in (4, 12):
        generate_plain_batch(graphed, rows, n)  # graphs captured outside the count
        with count_host_reads(tiny_llama.device) as counts:
            generate_plain_batch(graphed, rows, n)
        reads.append(sum(counts.values()))
    assert (reads[1] - reads[0]) / 8 <= 1
