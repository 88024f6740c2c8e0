"""Prompt lookup first, the drafter otherwise: exact output, and each draws where it should."""

import torch

from draftlab.inference.decoder import SpeculativeDecoder, generate_plain
from draftlab.inference.eagle import EagleProposer
from draftlab.inference.hybrid import lookup_first
from draftlab.inference.shapes import Chain
from draftlab.models.eagle import Eagle3Config, Eagle3Drafter


def _proposer(target, min_match):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    samples = [{"input_ids": torch.randint(0, target.vocab_size, (32,), generator=g), "loss_mask": torch.ones(32, dtype=torch.bool)} for _ in range(4)]
    return lookup_first(EagleProposer(Eagle3Drafter.build(Eagle3Config(draft_vocab_size=96), target, samples)), min_match)


def test_lookup_first_equals_plain_and_uses_both(tiny_llama):
    # a prompt that repeats itself gives lookup matches; fresh text leaves the drafter to draft
    base = torch.randint(0, tiny_llama.vocab_size, (12,), generator=torch.Generator().manual_seed(3))
    prompt = torch.cat([base, base, base[:6]])
    p = _proposer(tiny_llama, min_match=2)
    plain = generate_plain(tiny_llama, prompt, 48)
    spec = SpeculativeDecoder(tiny_llama, p).generate(prompt, 48, Chain(3))
    assert spec.tokens == plain.tokens
    assert 0 < p.lookup_steps < len(spec.accept_lengths)


def test_lookup_first_needs_min_match_tokens(tiny_llama):
    p = _proposer(tiny_llama, min_match=3)
    ids = torch.tensor([5, 6, 7, 9, 6, 7])  # "6 7" recurs, no 3-gram does
    out = tiny_llama(ids[None], layers=p.layers, logits="last")
    p.start(ids, out.hidden, 8)  # context ... 6 7 8: no earlier "7 8" either
    assert p.propose(Chain(3)).tokens.numel() == 3 and p.lookup_steps == 0  # the drafter drafted
    p.advance(torch.tensor([5, 6, 7]), {i: h[:, :3] for i, h in out.hidden.items()})
    draft = p.propose(Chain(3))  # "5 6 7" recurs now: lookup copies what followed it
    assert p.lookup_steps == 1 and draft.tokens.tolist() == [9, 6, 7]
