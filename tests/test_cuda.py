"""The batched speculative decoder on a CUDA device (skipped without one): every family, loaded
from a checkpoint onto the GPU as a user's would be, decodes greedy rows equal to plain batched
decoding there with the verify step on the Triton kernels, and sampling at B > 1 keeps each
row's distribution; the target's forwards replayed as CUDA graphs decode the tokens eager
forwards do. The kernels themselves: ``test_kernels.py::test_triton_kernels_on_cuda``."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from draftlab.inference.decoder import Decoder, generate_plain, generate_plain_batch
from draftlab.inference.graphs import GraphedTarget
from draftlab.inference.ngram import NgramProposer
from draftlab.inference.proposer import OwnModel, load_proposer
from draftlab.inference.shapes import Block, Chain, DynamicTree
from draftlab.kernels import triton_verify
from draftlab.models.drafter import DRAFTERS
from draftlab.models.target import Target
from tiny import assert_follows_target, random_samples, save_checkpoint

pytestmark = pytest.mark.cuda  # skipped without a CUDA device (conftest.py)

TEXTS = ["The quick brown fox jumps", "Speculative decoding drafts tokens and the target verifies them all at once",
         "a b c a b c a b"]
N_NEW = 24


@pytest.fixture(scope="module")
def cuda_llama(tiny_target_dirs):
    return Target.load(str(tiny_target_dirs["llama"]), device="cuda")


@pytest.fixture(scope="module")
def prompts(cuda_llama):
    return [cuda_llama.tokenizer(t)["input_ids"] for t in TEXTS]


def _proposer(algorithm, cpu_target, cuda_target, path):
    """A fresh drafter of ``algorithm`` built beside the CPU target, saved as a checkpoint and
    loaded beside the CUDA one (the path a user's trained checkpoint takes)."""
    if algorithm == "ngram":
        return NgramProposer(3, 1)
    cls = DRAFTERS.get(algorithm, "algorithm")
    torch.manual_seed(0)
    drafter = cls.build(cls.Config(), cpu_target, random_samples(cpu_target, 2))
    return load_proposer(save_checkpoint(drafter, cpu_target, path), cuda_target)


def _count_kernel_calls(monkeypatch) -> Counter:
    calls = Counter()
    for name in ("chain_verify_greedy", "chain_verify_sampling", "tree_verify_greedy", "tree_verify_sampling"):
        fn = getattr(triton_verify, name)
        monkeypatch.setattr(triton_verify, name, lambda *a, _fn=fn, _name=name, **k: calls.update([_name]) or _fn(*a, **k))
    return calls


@pytest.mark.parametrize("algorithm,shape", [("eagle3", Chain(3)), ("eagle1", DynamicTree(3, 2, 8)), ("medusa", Chain(2)),
                                             ("diffusion", Block(3)), ("draft_lm", Chain(3)), ("draft_lm", DynamicTree(3, 2, 8)),
                                             ("ngram", Chain(3)), ("ngram", DynamicTree(3, 2, 8))])
def test_every_family_decodes_batches_on_cuda(tiny_llama, cuda_llama, prompts, algorithm, shape, tmp_path, monkeypatch):
    proposer = _proposer(algorithm, tiny_llama, cuda_llama, tmp_path / "ckpt")
    plain = [r.tokens for r in generate_plain_batch(cuda_llama, prompts, N_NEW).rows]
    calls = _count_kernel_calls(monkeypatch)
    res = Decoder(cuda_llama, proposer, loop="host").generate(prompts, N_NEW, shape)
    assert [r.tokens for r in res.rows] == plain
    assert sum(calls.values()) >= res.num_steps > 0, calls  # every drafting step verified by a kernel
    # CUDA's default: the device loop where the family drafts on the device, else the host loop
    assert [r.tokens for r in Decoder(cuda_llama, proposer).generate(prompts, N_NEW, shape).rows] == plain
    # batched arithmetic may round differently from a batch of one: said, not hidden
    alone = [generate_plain(cuda_llama, p, N_NEW).tokens for p in prompts]
    print(f"{algorithm}: batched rows equal to each alone on CUDA: {sum(a == b for a, b in zip(alone, plain))}/{len(plain)}")


def test_batched_sampling_on_cuda_preserves_each_rows_distribution(tiny_llama, cuda_llama, prompts, tmp_path, monkeypatch):
    """Two rows, an EAGLE-3 drafter with real draft probabilities: each row's first two tokens
    follow the target's top-k=3 distribution (chi-square against the exact joint), drafts were
    verified by the Triton sampling kernel, and the test has power (a skewed joint is rejected)."""
    ps = prompts[:2]
    temperature, top_k, n = 1.0, 3, 400
    dec = Decoder(cuda_llama, _proposer("eagle3", tiny_llama, cuda_llama, tmp_path / "ckpt"))
    calls = _count_kernel_calls(monkeypatch)
    counts = [Counter(), Counter()]
    for s in range(n):
        res = dec.generate(ps, 2, Chain(2), temperature=temperature, top_k=top_k, seed=s)
        for b in range(2):
            counts[b][tuple(res.rows[b].tokens)] += 1
    assert calls["chain_verify_sampling"] >= n, calls
    for b, p in enumerate(ps):
        assert_follows_target(counts[b], tiny_llama, p, 2, temperature, top_k, n)


@pytest.mark.parametrize("algorithm,shape,loop", [(None, None, "host"), (None, None, "device"), ("eagle3", Chain(3), "host"),
                                                  ("eagle3", Chain(3), "device"), ("draft_lm", DynamicTree(3, 2, 8), "host"),
                                                  ("ngram", Chain(3), "host")])
def test_cuda_graph_decoding_equals_eager(tiny_llama, cuda_llama, prompts, algorithm, shape, loop, tmp_path):
    """Real CUDA graphs over the static caches: the same tokens and accepted lengths as eager
    forwards over the ragged cache. Host loop: every step's target forward replayed (and the
    draft LM's), none eager, a second decoding captures nothing new. Device loop: every whole
    step replayed from the graphs captured before the first decoding's prefill."""
    if loop == "device":
        from draftlab.inference.spec_loop import kept_loops

        kept_loops(cuda_llama).clear()
        proposer = None if algorithm is None else _proposer(algorithm, tiny_llama, cuda_llama, tmp_path / "d")
        eager = Decoder(cuda_llama, proposer, loop="host").generate(prompts, N_NEW, shape)
        graphed = GraphedTarget(cuda_llama)
        for _ in range(2):
            res = Decoder(graphed, proposer, loop="device").generate(prompts, N_NEW, shape)
            assert [r.tokens for r in res.rows] == [r.tokens for r in eager.rows]
            assert [r.accept_lengths for r in res.rows] == [r.accept_lengths for r in eager.rows]
        (kept,) = kept_loops(cuda_llama).values()
        assert kept.mode == "cuda" and kept.stats["eager"] == 0 and kept.stats["replayed"] >= 2 * eager.num_steps > 0
        assert kept.stats["captured"] == len(kept.buckets)
        return
    graphed, drafter = GraphedTarget(cuda_llama), []

    def graphed_proposer(path):
        proposer = _proposer(algorithm, tiny_llama, cuda_llama, path)
        if isinstance(proposer, OwnModel):  # a draft LM: its own forwards are graphed too
            proposer.use_graphs(lambda model: drafter.append(GraphedTarget(model)) or drafter[-1])
        return proposer

    if algorithm is None:
        eager = Decoder(cuda_llama, loop="host").generate(prompts, N_NEW, None)
        decode = lambda i: Decoder(graphed, loop="host").generate(prompts, N_NEW, None)  # noqa: E731
    else:
        eager = Decoder(cuda_llama, _proposer(algorithm, tiny_llama, cuda_llama, tmp_path / "a"), loop="host").generate(prompts, N_NEW, shape)
        decode = lambda i: Decoder(graphed, graphed_proposer(tmp_path / f"b{i}"), loop="host").generate(prompts, N_NEW, shape)  # noqa: E731
    captured = []
    for i in range(2):
        res = decode(i)
        captured.append(graphed.stats["captured"])
        assert [r.tokens for r in res.rows] == [r.tokens for r in eager.rows]
        assert [r.accept_lengths for r in res.rows] == [r.accept_lengths for r in eager.rows]
    assert graphed.stats["replayed"] >= 2 * eager.num_steps > 0 and not any(k.startswith("eager") for k in graphed.stats)
    assert captured[1] == captured[0] > 0
    assert len(drafter) == 2 * (algorithm == "draft_lm")  # the draft LM's own forwards replayed too
    for g in drafter:
        assert g.stats["replayed"] > 0 and not any(k.startswith("eager") for k in g.stats)


def test_cuda_graph_prefill_equals_eager(cuda_llama):
    """Prompts' prefills replayed from their widths' CUDA graphs (padded past the prompt), one
    GraphedTarget for all, give the eager prefill's K/V, last logits and hidden states, also
    after small blocks freed since the captures were taken again and filled with values no index
    may hold (a tensor only the graph held was once freed that way: its replays read garbage)."""
    graphed = GraphedTarget(cuda_llama)
    layers = (0, 2, cuda_llama.num_layers)
    torch.manual_seed(0)
    prompts = [torch.randint(0, cuda_llama.vocab_size, (n,), device="cuda") for n in (1, 5, 33, 100)]
    for round_ in range(2):
        for prompt in prompts:
            n = prompt.numel()
            cache = cuda_llama.new_cache(1, n)
            eager = cuda_llama(prompt[None], layers=list(layers), cache=cache, logits="last")
            done = graphed.prefill_prompt(prompt, layers)
            torch.testing.assert_close(done.k, cache.k[:, 0, :, :n], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(done.logits, eager.logits[0, -1], atol=1e-3, rtol=1e-3)
            for i in layers:
                torch.testing.assert_close(done.hidden[i], eager.hidden[i], atol=1e-3, rtol=1e-3)
        junk = [torch.full((k,), 2**40, dtype=torch.long, device="cuda") for k in (1, 2, 4, 8, 64) for _ in range(64)]
        del junk
    torch.cuda.synchronize()
    assert graphed.stats["prefills replayed"] == 8 and graphed.stats["prefill widths captured"] == 3
