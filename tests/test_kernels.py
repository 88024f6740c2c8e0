"""Verify kernels: hand-checked references, Triton (interpreter, and CUDA where there is one) ==
reference, losslessness.

Running Triton on CPU needs its interpreter, and TRITON_INTERPRET=1 only takes effect if it is
set before ``triton`` is first imported (Triton jits its own ``tl.*`` library at import). Inside
one pytest session some other test or library may already have imported triton, and setting the
variable globally would leak into every other test, so the Triton-vs-reference checks
(``interp_*`` below) run in a fresh subprocess: ``test_triton_kernels_under_interpreter`` starts
``pytest`` on this file with TRITON_INTERPRET=1 and DRAFTLAB_KERNELS_INTERP=1 in its environment,
and only there are the ``interp_*`` functions exposed as tests. Its failure output is the child's
pytest report. ``interp_*`` also asserts the kernels really run interpreted (triton_verify's
INTERPRETED), so a misconfigured child fails instead of skipping. On a machine with CUDA,
``test_triton_kernels_on_cuda`` runs the same ``interp_*`` checks compiled for the GPU
(DRAFTLAB_KERNELS_CUDA=1, no interpreter): the reference on CPU, the kernels on CUDA copies.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import draftlab.kernels as K
from draftlab.errors import DraftlabError
from draftlab.kernels import reference

_CHILD = os.environ.get("DRAFTLAB_KERNELS_INTERP") == "1"
_CUDA = os.environ.get("DRAFTLAB_KERNELS_CUDA") == "1"  # the child runs the kernels on the GPU
_KERNEL_DEVICE = "cuda" if _CUDA else "cpu"


@pytest.fixture
def triton_kernels(monkeypatch):
    """The Triton kernels module, interpreted (compiled for the GPU in the CUDA child), with a
    16-wide vocab block so V=50 spans 4 blocks (the last one partial)."""
    from draftlab.kernels import triton_verify

    if _CUDA:
        assert torch.cuda.is_available() and not triton_verify.INTERPRETED, "the CUDA child runs interpreted"
    else:
        assert triton_verify.INTERPRETED, "TRITON_INTERPRET=1 was not in effect at triton import"
    monkeypatch.setattr(triton_verify, "MAX_BLOCK_V", 16)
    return triton_verify


def _torch(fn, *args):
    return fn(*args, backend="torch")


def _both(fn, *args):
    """Run fn on the torch backend (CPU) and the Triton one (on the kernels' device); assert
    identical outputs; return them."""
    ref = fn(*args, backend="torch")
    tri = fn(*(a.to(_KERNEL_DEVICE) if isinstance(a, torch.Tensor) else a for a in args), backend="triton")
    for r, t in zip(ref, tri):
        assert t.device.type == _KERNEL_DEVICE
        t = t.cpu()
        assert r.dtype == t.dtype == torch.long
        assert torch.equal(r, t), f"torch:\n{r}\ntriton:\n{t}"
    return ref


# ---------------------------------------------------------------------------------------------
# hand-checked cases: `run(fn, *args)` is _torch here and _both in the interpreter child

def hand_chain_greedy(run):
    # req0: 5, 6 accepted, 7 != 9 -> correction 9; req1: no drafts -> bonus 8;
    # req2: 1, 2 accepted -> bonus 3
    cu = torch.tensor([0, 3, 3, 5])
    drafts = torch.tensor([5, 6, 7, 1, 2])
    target = torch.tensor([5, 6, 9, 4, 8, 1, 2, 3])
    out, n = run(K.chain_verify_greedy, drafts, cu, target)
    assert out.tolist() == [[5, 6, 9, -1], [8, -1, -1, -1], [1, 2, 3, -1]]
    assert n.tolist() == [2, 0, 2]


def hand_chain_greedy_no_drafts(run):
    out, n = run(K.chain_verify_greedy, torch.zeros(0, dtype=torch.long), torch.tensor([0, 0, 0]),
                 torch.tensor([4, 7]))
    assert out.tolist() == [[4], [7]] and n.tolist() == [0, 0]


def hand_chain_sampling(run):
    # V=4, dyadic probabilities so every ratio is exact.
    cu = torch.tensor([0, 2, 3, 4])
    drafts = torch.tensor([1, 2, 0, 3])
    p = torch.tensor([
        [0.125, 0.5, 0.25, 0.125],    # req0 pos0: p(1)=.5, q(1)=.25 -> ratio 2: accept
        [0.5, 0.125, 0.25, 0.125],    # req0 pos1: p(2)=.25, q(2)=.75 -> ratio 1/3 < u=.5: reject
        [0.25, 0.25, 0.25, 0.25],     # req0 bonus row (unused)
        [0.25, 0.25, 0.25, 0.25],     # req1 pos0: p(0)=.25, q(0)=.5 -> ratio .5 == u: accept
        [0.0, 0.5, 0.5, 0.0],         # req1 bonus: argmax(p / E) = 2 with E[1] = 2
        [0.5, 0.25, 0.0, 0.25],       # req2 pos0: q(3) = 0 -> rejected whatever u (p/q = inf)
        [1.0, 0.0, 0.0, 0.0],         # req2 bonus row (unused)
    ])
    q = torch.tensor([
        [0.25, 0.25, 0.25, 0.25],
        [0.125, 0.0, 0.75, 0.125],
        [0.5, 0.25, 0.25, 0.0],
        [0.25, 0.25, 0.5, 0.0],
    ])
    u = torch.tensor([0.9, 0.5, 0.5, 0.0], dtype=torch.float64)
    e = torch.ones(7, 4)
    e[1] = torch.tensor([4.0, 1.0, 1.0, 1.0])  # residual [.375, .125, 0, 0]/E -> .09375 < .125: 1
    e[4] = torch.tensor([1.0, 2.0, 1.0, 1.0])
    e[5] = torch.tensor([2.0, 1.0, 1.0, 1.0])  # residual [.25, 0, 0, .25] / E -> 3
    out, n = run(K.chain_verify_sampling, drafts, cu, p, q, u, e)
    assert out.tolist() == [[1, 1, -1], [0, 2, -1], [3, -1, -1]]
    assert n.tolist() == [1, 1, 0]


def hand_chain_sampling_point_mass(run):
    # q = one-hot(draft): accept iff u <= p(x); residual = p without x.
    cu = torch.tensor([0, 2, 3])
    drafts = torch.tensor([1, 3, 2])
    p = torch.tensor([
        [0.125, 0.5, 0.25, 0.125],   # req0 pos0: p(1)=.5 >= u=.5: accept
        [0.5, 0.125, 0.25, 0.125],   # req0 pos1: p(3)=.125 < u=.75: reject -> [.5,.125,.25,0]/E
        [0.25, 0.25, 0.25, 0.25],
        [0.125, 0.125, 0.5, 0.25],   # req1 pos0: p(2)=.5 < u=.625: reject -> [.125,.125,0,.25]
        [0.25, 0.25, 0.25, 0.25],
    ])
    u = torch.tensor([0.5, 0.75, 0.625], dtype=torch.float64)
    e = torch.ones(5, 4)
    e[1, 0] = 8.0   # .5/8 < .25: picks 2
    out, n = run(K.chain_verify_sampling, drafts, cu, p, None, u, e)
    assert out.tolist() == [[1, 2, -1], [3, -1, -1]]
    assert n.tolist() == [1, 0]


def _hand_tree():
    # node: 0 root, 1 (tok 5, parent 0), 2 (tok 6, parent 0), 3 (tok 7, parent 1),
    #       4 (tok 8, parent 3), 5 padding
    tokens = torch.tensor([[0, 5, 6, 7, 8, -1]] * 2)
    parents = torch.tensor([[-1, 0, 0, 1, 3, -1]] * 2)
    return tokens, parents


def hand_tree_greedy(run):
    tokens, parents = _hand_tree()
    target = torch.tensor([[6, 1, 2, 8, 9, 0],     # root -> node 2 (tok 6), leaf -> bonus 2
                           [5, 7, 3, 8, 9, 0]])    # 0 -> 1 -> 3 -> 4 -> bonus 9
    path, out, n = run(K.tree_verify_greedy, tokens, parents, target)
    assert path.tolist() == [[0, 2, -1, -1], [0, 1, 3, 4]]
    assert out.tolist() == [[6, 2, -1, -1], [5, 7, 8, 9]]
    assert n.tolist() == [1, 3]
    # no child matches at the root: correction only
    path, out, n = run(K.tree_verify_greedy, tokens, parents, torch.full_like(target, 3))
    assert path[:, :2].tolist() == [[0, -1]] * 2 and out[:, :2].tolist() == [[3, -1]] * 2
    assert n.tolist() == [0, 0]


def hand_tree_sampling(run):
    # V=4; root children: node 1 (tok 1), node 2 (tok 2); node 1 has child node 3 (tok 3).
    tokens = torch.tensor([[0, 1, 2, 3]] * 2)
    parents = torch.tensor([[-1, 0, 0, 1]] * 2)
    p = torch.full((2, 4, 4), 0.25)
    p[:, 0] = torch.tensor([0.125, 0.375, 0.25, 0.25])
    p[:, 2] = torch.tensor([0.0, 0.5, 0.25, 0.25])
    e = torch.ones(2, 4, 4)
    e[0, 2] = torch.tensor([1.0, 4.0, 1.0, 1.0])   # bonus at node 2: [0, .125, .25, .25] -> 2
    e[1, 0] = torch.tensor([0.25, 1.0, 1.0, 1.0])  # correction [.5, 0, 0, .25] -> 0 (3 if E=1)
    # tree 0: node 1 ratio .375 < .5 rejected; node 2 ratio .25/.625 = .4 >= .3 accepted; leaf.
    # tree 1: node 1 rejected; node 2 ratio .4 < .5 rejected -> correction from [.125,0,0,.25].
    u = torch.tensor([[0.0, 0.5, 0.3, 0.0], [0.0, 0.5, 0.5, 0.0]], dtype=torch.float64)
    path, out, n = run(K.tree_verify_sampling, tokens, parents, p, u, e)
    assert path.tolist() == [[0, 2, -1], [0, -1, -1]]
    assert out.tolist() == [[2, 2, -1], [0, -1, -1]]
    assert n.tolist() == [1, 0]
    # all coins 0: first child at every level, down to the leaf node 3 (bonus argmax p[3] = 0)
    path, out, n = run(K.tree_verify_sampling, tokens, parents, p, torch.zeros_like(u), e)
    assert path.tolist() == [[0, 1, 3]] * 2 and out.tolist() == [[1, 3, 0]] * 2


def hand_tree_padding_and_unreachable_nodes(run):
    # node 2 is padding, node 3 hangs below it: neither counts for D nor can be accepted;
    # same-token siblings under different parents are fine
    tokens = torch.tensor([[0, 5, 9, 5, 5]])
    parents = torch.tensor([[-1, 0, -1, 2, 1]])
    path, out, n = run(K.tree_verify_greedy, tokens, parents, torch.tensor([[5, 5, 5, 5, 1]]))
    assert path.tolist() == [[0, 1, 4]] and out.tolist() == [[5, 5, 1]] and n.tolist() == [2]


def hand_empty_batch(run):
    none, empty_f64 = torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.float64)
    out, n = run(K.chain_verify_greedy, none, torch.tensor([0]), none)
    assert out.shape == (0, 1) and n.shape == (0,)
    out, n = run(K.chain_verify_sampling, none, torch.tensor([0]), torch.zeros(0, 4), None,
                 empty_f64, torch.ones(0, 4))
    assert out.shape == (0, 1) and n.shape == (0,)
    trees = torch.zeros(0, 3, dtype=torch.long)
    path, out, n = run(K.tree_verify_greedy, trees, trees, trees)
    assert path.shape == out.shape == (0, 1) and n.shape == (0,)
    path, out, n = run(K.tree_verify_sampling, trees, trees, torch.zeros(0, 3, 4),
                       torch.zeros(0, 3, dtype=torch.float64), torch.ones(0, 3, 4))
    assert path.shape == out.shape == (0, 1) and n.shape == (0,)


HAND_CASES = [hand_chain_greedy, hand_chain_greedy_no_drafts, hand_chain_sampling,
              hand_chain_sampling_point_mass, hand_tree_greedy, hand_tree_sampling,
              hand_tree_padding_and_unreachable_nodes, hand_empty_batch]


@pytest.mark.parametrize("case", HAND_CASES, ids=lambda f: f.__name__[5:])
def test_reference_hand_cases(case):
    case(_torch)


@pytest.mark.parametrize("case", HAND_CASES, ids=lambda f: f.__name__[5:])
def interp_hand_cases(triton_kernels, case):
    case(_both)


# ---------------------------------------------------------------------------------------------
# Triton (interpreter) == reference on random inputs

def _chain_inputs(gen, lengths, vocab, modes, with_q=True):
    """Random ragged chain batch. modes[b]: 'random', 'accept' (all drafts accepted) or
    'reject' (first draft rejected)."""
    cu = torch.tensor([0] + lengths).cumsum(0)
    n, batch = int(cu[-1]), len(lengths)
    p = torch.softmax(torch.randn(n + batch, vocab, generator=gen) * 2, dim=-1)
    q = torch.softmax(torch.randn(n, vocab, generator=gen) * 2, dim=-1)
    q[:, 0] = 0.0  # tokens q cannot propose; token 0 then only comes from the residual
    q = q / q.sum(-1, keepdim=True)
    drafts = torch.multinomial(q, 1, generator=gen).squeeze(1) if n else torch.zeros(0).long()
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    for b, mode in enumerate(modes):
        lo, hi = int(cu[b]), int(cu[b + 1])
        if mode == "accept":
            u[lo:hi] = 0.0
        elif mode == "reject" and hi > lo:
            rows = lo + b
            # draft the token with the smallest p/q: ratio < 1 (p != q), so u = 1 rejects
            ratio = p[rows] / (q[lo] if with_q else torch.ones(vocab))
            drafts[lo] = torch.where(q[lo] > 0, ratio, torch.inf).argmin() if with_q \
                else ratio.argmin()
            u[lo] = 1.0
    e = torch.empty(n + batch, vocab).exponential_(generator=gen)
    return drafts, cu, p, (q if with_q else None), u, e


CHAIN_CASES = {
    "ragged": ([3, 0, 4, 1, 2, 5], ["random", "random", "accept", "reject", "random", "accept"]),
    "first_rejected": ([2, 3], ["reject", "reject"]),
    "all_accepted": ([4, 1], ["accept", "accept"]),
    "no_drafts": ([0, 0, 0], ["random"] * 3),
}


@pytest.mark.parametrize("case", CHAIN_CASES)
def interp_chain_greedy_matches_reference(triton_kernels, case):
    lengths, modes = CHAIN_CASES[case]
    gen = torch.Generator().manual_seed(1)
    cu = torch.tensor([0] + lengths).cumsum(0)
    n, batch = int(cu[-1]), len(lengths)
    target = torch.randint(0, 8, (n + batch,), generator=gen)
    drafts = torch.randint(0, 8, (n,), generator=gen)
    for b, mode in enumerate(modes):  # mostly agree with the target so prefixes vary
        lo, hi = int(cu[b]), int(cu[b + 1])
        agree = torch.rand(hi - lo, generator=gen) < (1.0 if mode == "accept" else 0.7)
        drafts[lo:hi] = torch.where(agree, target[lo + b:hi + b], drafts[lo:hi])
        if mode == "reject" and hi > lo:
            drafts[lo] = target[lo + b] + 1
    out, num = _both(K.chain_verify_greedy, drafts, cu, target)
    lengths_t = torch.tensor(lengths)
    assert out.shape == (batch, max(lengths) + 1)
    for b, mode in enumerate(modes):
        if mode == "accept":
            assert num[b] == lengths[b]
        if mode == "reject":
            assert num[b] == 0
    assert (num <= lengths_t).all()


@pytest.mark.parametrize("with_q", [True, False], ids=["draft_probs", "point_mass"])
@pytest.mark.parametrize("case", CHAIN_CASES)
def interp_chain_sampling_matches_reference(triton_kernels, case, with_q):
    lengths, modes = CHAIN_CASES[case]
    gen = torch.Generator().manual_seed(2)
    args = _chain_inputs(gen, lengths, 50, modes, with_q)
    out, num = _both(K.chain_verify_sampling, *args)
    for b, mode in enumerate(modes):
        if mode == "accept":
            assert num[b] == lengths[b]
        if mode == "reject" and lengths[b]:
            assert num[b] == 0


def interp_chain_sampling_bf16_and_full_block(triton_kernels, monkeypatch):
    """bf16 inputs (loaded as fp32 on both paths) and the default, single vocab block."""
    monkeypatch.setattr(triton_kernels, "MAX_BLOCK_V", 1024)
    gen = torch.Generator().manual_seed(3)
    drafts, cu, p, q, u, e = _chain_inputs(gen, [2, 3, 1], 64, ["random"] * 3)
    _both(K.chain_verify_sampling, drafts, cu, p.bfloat16(), q.bfloat16(), u, e.bfloat16())


def interp_chain_sampling_tie_goes_to_lowest_token(triton_kernels):
    # bonus row with equal maxima in blocks 0 and 2 (16-wide blocks): both must pick token 3
    p = torch.zeros(1, 50)
    p[0, 3] = p[0, 40] = 0.5
    out, _ = _both(K.chain_verify_sampling, torch.zeros(0, dtype=torch.long), torch.tensor([0, 0]),
                   p, None, torch.zeros(0, dtype=torch.float64), torch.ones(1, 50))
    assert out.tolist() == [[3]]


def _random_trees(gen, sizes, n_nodes, vocab):
    """Ragged random trees (distinct sibling tokens) padded to n_nodes. A tree of size s uses
    nodes 0..s-1 except that node 2 is made padding when s > 4 (its subtree is unreachable)."""
    batch = len(sizes)
    tokens = torch.full((batch, n_nodes), -1, dtype=torch.long)
    parents = torch.full((batch, n_nodes), -1, dtype=torch.long)
    for b, size in enumerate(sizes):
        tokens[b, 0] = int(torch.randint(0, vocab, (), generator=gen))
        for c in range(1, size):
            parent = int(torch.randint(0, c, (), generator=gen))
            taken = tokens[b, 1:c][parents[b, 1:c] == parent].tolist()
            free = [t for t in range(vocab) if t not in taken]
            parents[b, c] = parent
            tokens[b, c] = free[int(torch.randint(0, len(free), (), generator=gen))]
        if size > 4:
            parents[b, 2], tokens[b, 2] = -1, -1
    return tokens, parents


TREE_SIZES = [1, 9, 6, 7]


def _greedy_targets(gen, tokens, parents, vocab):
    """Target argmax that matches some child of the node ~70% of the time."""
    target = torch.randint(0, vocab, tokens.shape, generator=gen)
    for b in range(tokens.shape[0]):
        for u in range(tokens.shape[1]):
            kids = (parents[b] == u).nonzero().flatten().tolist()
            if kids and torch.rand((), generator=gen) < 0.7:
                target[b, u] = tokens[b, kids[int(torch.randint(0, len(kids), (), generator=gen))]]
    return target


def interp_tree_greedy_matches_reference(triton_kernels):
    gen = torch.Generator().manual_seed(4)
    tokens, parents = _random_trees(gen, TREE_SIZES, 9, 6)
    target = _greedy_targets(gen, tokens, parents, 6)
    path, out, num = _both(K.tree_verify_greedy, tokens, parents, target)
    assert num[0] == 0 and num.max() > 1  # root-only tree; some multi-step path
    # a path follows parent links and out repeats the accepted tokens
    for b in range(len(TREE_SIZES)):
        for d in range(1, int(num[b]) + 1):
            assert parents[b, path[b, d]] == path[b, d - 1]
            assert out[b, d - 1] == tokens[b, path[b, d]]


@pytest.mark.parametrize("coins", ["random", "accept", "reject"])
def interp_tree_sampling_matches_reference(triton_kernels, coins):
    gen = torch.Generator().manual_seed(5)
    vocab = 50
    tokens, parents = _random_trees(gen, TREE_SIZES, 9, vocab)
    logits = torch.randn(len(TREE_SIZES), 9, vocab, generator=gen)
    for b in range(len(TREE_SIZES)):  # boost children's tokens so acceptance is common
        for c in range(1, 9):
            if parents[b, c] >= 0:
                logits[b, parents[b, c], tokens[b, c]] += 3.0
    p = torch.softmax(logits, dim=-1)
    u = {"random": torch.rand(len(TREE_SIZES), 9, generator=gen, dtype=torch.float64),
         "accept": torch.zeros(len(TREE_SIZES), 9, dtype=torch.float64),
         "reject": torch.ones(len(TREE_SIZES), 9, dtype=torch.float64)}[coins]
    e = torch.empty(len(TREE_SIZES), 9, vocab).exponential_(generator=gen)
    path, out, num = _both(K.tree_verify_sampling, tokens, parents, p, u, e)
    if coins == "reject":
        assert (num == 0).all()
        # the correction never re-emits a rejected child token
        for b in range(len(TREE_SIZES)):
            assert out[b, 0] not in tokens[b, 1:][parents[b, 1:] == 0].tolist()
    if coins == "accept":
        assert num.tolist()[1:] != [0, 0, 0]


def interp_tree_root_only_batch(triton_kernels):
    gen = torch.Generator().manual_seed(6)
    tokens = torch.tensor([[3], [4]])
    parents = torch.tensor([[-1], [-1]])
    path, out, num = _both(K.tree_verify_greedy, tokens, parents, torch.tensor([[7], [9]]))
    assert path.tolist() == [[0], [0]] and out.tolist() == [[7], [9]] and num.tolist() == [0, 0]
    p = torch.softmax(torch.randn(2, 1, 20, generator=gen), -1)
    _both(K.tree_verify_sampling, tokens, parents, p, torch.rand(2, 1, dtype=torch.float64),
          torch.empty(2, 1, 20).exponential_(generator=gen))


# ---------------------------------------------------------------------------------------------
# statistical losslessness: the first emitted token follows the target distribution

DRAWS = 100_000
P_TOY = torch.tensor([0.35, 0.05, 0.25, 0.15, 0.20])
Q_TOY = torch.tensor([0.05, 0.40, 0.10, 0.30, 0.15])


def chi2_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit. For an even number of degrees of freedom 2k the
    survival function is exact in closed form: P(X > x) = exp(-x/2) sum_{i<k} (x/2)^i / i!
    (so no scipy is needed)."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = probs.numel() - 1
    assert dof % 2 == 0
    half = stat / 2
    return math.exp(-half) * sum(half ** i / math.factorial(i) for i in range(dof // 2))


ALPHA = 1e-4  # false-alarm rate of the honest tests (deterministic seeds anyway)


def _chain_first_tokens(with_q: bool, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (DRAWS,), generator=gen)  # includes K=0 (bonus only)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    n = int(cu[-1])
    # every position uses the toy p (rows) and q; drafts ~ q, also for point-mass proposals
    p = P_TOY.expand(n + DRAWS, -1).contiguous()
    q = Q_TOY.expand(n, -1).contiguous()
    drafts = torch.multinomial(Q_TOY, n, replacement=True, generator=gen)
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    e = torch.empty(n + DRAWS, 5).exponential_(generator=gen)
    out, _ = _torch(K.chain_verify_sampling, drafts, cu, p, q if with_q else None, u, e)
    return out[:, 0]


@pytest.mark.parametrize("with_q", [True, False], ids=["draft_probs", "point_mass"])
def test_chain_sampling_is_lossless(with_q):
    assert chi2_pvalue(_chain_first_tokens(with_q, seed=10), P_TOY) > ALPHA


@pytest.mark.parametrize("with_q", [True, False], ids=["draft_probs", "point_mass"])
def test_chain_lossless_check_catches_biased_recovery(monkeypatch, with_q):
    # recovering from p instead of max(p - q, 0) is the classic lossy bug
    monkeypatch.setattr(reference, "_residual", lambda p, q: p)
    assert chi2_pvalue(_chain_first_tokens(with_q, seed=10), P_TOY) < ALPHA


# root (tok random) with 3 children, child 1 has 2 children; per-node toy target rows
TREE_PARENTS = [-1, 0, 0, 0, 1, 1]


def _tree_first_tokens(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    nodes = len(TREE_PARENTS)
    parents = torch.tensor(TREE_PARENTS).expand(DRAWS, -1).contiguous()
    # distinct random sibling tokens, drawn without replacement from a skewed distribution:
    # exchangeable (uniform) candidates would average a biased correction back to p
    tokens = torch.zeros(DRAWS, nodes, dtype=torch.long)
    tokens[:, 1:4] = torch.multinomial(Q_TOY.expand(DRAWS, -1), 3, generator=gen)
    tokens[:, 4:6] = torch.multinomial(Q_TOY.expand(DRAWS, -1), 2, generator=gen)
    rows = torch.softmax(torch.randn(nodes, 5, generator=gen), dim=-1)
    rows[0] = P_TOY
    p = rows.expand(DRAWS, -1, -1).contiguous()
    u = torch.rand(DRAWS, nodes, generator=gen, dtype=torch.float64)
    e = torch.empty(DRAWS, nodes, 5).exponential_(generator=gen)
    _, out, _ = _torch(K.tree_verify_sampling, tokens, parents, p, u, e)
    return out[:, 0]


def test_tree_sampling_is_lossless():
    assert chi2_pvalue(_tree_first_tokens(seed=11), P_TOY) > ALPHA


def test_tree_lossless_check_catches_biased_correction(monkeypatch):
    # correcting from p (rejected siblings' mass kept) instead of the residual
    monkeypatch.setattr(reference, "_remove_tokens", lambda r, tokens, mask: r)
    assert chi2_pvalue(_tree_first_tokens(seed=11), P_TOY) < ALPHA


# ---------------------------------------------------------------------------------------------
# the decoder's accept rule: greedy or sampling, coins and noise drawn from the generation's generator

def _sampling(temperature: float, seed: int = 0):
    from draftlab.inference.sampling import Sampling

    return Sampling(temperature, top_k=4, generator=torch.Generator().manual_seed(seed))


def _coins_then_noise(sampling, coins: tuple, noise: tuple):
    """The verifier's draws in the decoder's order: float64 uniforms, then Exp(1) noise."""
    u = torch.rand(*coins, dtype=torch.float64, generator=sampling.generator)
    return u, torch.empty(*noise).exponential_(generator=sampling.generator)


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampling"])
def test_accept_chains_is_the_verifiers_with_the_generations_draws(temperature):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 12, generator=gen)
    drafts = logits[:3].argmax(-1)
    drafts[2] = (drafts[2] + 1) % 12  # accept two, reject the third (greedy)
    q = torch.softmax(torch.randn(3, 12, generator=gen), -1)
    tokens, n = K.accept_chains([drafts], logits[None], _sampling(temperature, 5), [q], backend="torch")
    s, cu = _sampling(temperature, 5), torch.tensor([0, 3])
    if temperature == 0.0:
        out, num = K.chain_verify_greedy(drafts, cu, logits.argmax(-1), backend="torch")
        assert n == [2]
    else:
        u, e = _coins_then_noise(s, (3,), (4, 12))
        out, num = K.chain_verify_sampling(drafts, cu, s.probs(logits), q, u, e, backend="torch")
    assert (tokens, n) == ([out[0, : int(num[0]) + 1].tolist()], [int(num[0])])


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampling"])
def test_accept_trees_is_the_verifiers_with_the_generations_draws(temperature):
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 12, generator=gen)
    tokens = torch.tensor([7, logits[0].argmax(), (logits[0].argmax() + 1) % 12, logits[1].argmax()])
    parents = torch.tensor([-1, 0, 0, 1])
    path, emitted, n = K.accept_trees(tokens[None], parents[None], logits[None], _sampling(temperature, 6), backend="torch")
    s = _sampling(temperature, 6)
    if temperature == 0.0:
        want = K.tree_verify_greedy(tokens[None], parents[None], logits.argmax(-1)[None], backend="torch")
        assert n == [2] and path.tolist() == [[0, 1, 3]]
    else:
        u, e = _coins_then_noise(s, (1, 4), (1, 4, 12))
        want = K.tree_verify_sampling(tokens[None], parents[None], s.probs(logits[None]), u, e, backend="torch")
    m = int(want[2][0])
    assert torch.equal(path, want[0]) and (emitted, n) == ([want[1][0, : m + 1].tolist()], [m])


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampling"])
def test_accept_without_drafts_emits_the_targets_token(temperature):
    """A row with nothing to verify (an empty chain, a root-only tree) emits one token: the
    target's argmax when greedy, else the bonus draw from the target's distribution."""
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(5))
    s, none = _sampling(temperature, 7), torch.zeros(0, dtype=torch.long)
    tokens, n = K.accept_chains([none], logits[None], _sampling(temperature, 7))
    path, emitted, m = K.accept_trees(torch.tensor([[3]]), torch.tensor([[-1]]), logits[None], _sampling(temperature, 7))
    assert n == m == [0] and path.tolist() == [[0]]
    if temperature == 0.0:
        assert tokens == emitted == [[int(logits[0].argmax())]]
        return
    u, e = _coins_then_noise(s, (0,), (1, 12))
    assert tokens == [[int(torch.argmax(s.probs(logits[0]) / e[0]))]]
    s = _sampling(temperature, 7)
    u, e = _coins_then_noise(s, (1, 1), (1, 1, 12))
    assert emitted == [[int(torch.argmax(s.probs(logits[0]) / e[0, 0]))]]


# ---------------------------------------------------------------------------------------------
# dispatch and validation

def test_auto_on_cpu_never_touches_triton(monkeypatch):
    def boom():
        raise AssertionError("auto on CPU imported Triton")

    monkeypatch.setattr(K, "_load_triton", boom)
    out, _ = K.chain_verify_greedy(torch.tensor([1]), torch.tensor([0, 1]), torch.tensor([1, 2]))
    assert out.tolist() == [[1, 2]]


def test_import_and_auto_work_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import os, torch, draftlab.kernels as K\n"
        "from draftlab.errors import DraftlabError\n"
        "_, out, n = K.tree_verify_greedy(torch.tensor([[0, 4]]), torch.tensor([[-1, 0]]),"
        " torch.tensor([[4, 2]]))\n"
        "assert out.tolist() == [[4, 2]], out\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "try:\n"
        "    K.chain_verify_greedy(torch.tensor([1]), torch.tensor([0, 1]), torch.tensor([1, 2]),"
        " backend='triton')\n"
        "except DraftlabError as exc:\n"
        "    assert 'unavailable' in str(exc), exc\n"
        "else:\n"
        "    raise SystemExit('forced triton did not fail')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_auto_on_cuda_without_triton_falls_back_with_a_warning(monkeypatch):
    def unavailable():
        raise DraftlabError("backend='triton': Triton is unavailable (ImportError: test)")

    monkeypatch.setattr(K, "_load_triton", unavailable)
    monkeypatch.setattr(K, "_warned_fallback", False)
    with pytest.warns(UserWarning, match="falling back"):
        assert K._backend("auto", torch.device("cuda")) is reference
    with pytest.raises(DraftlabError, match="unavailable"):
        K._backend("triton", torch.device("cuda"))


def test_forced_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(DraftlabError, match="TRITON_INTERPRET"):
        K.chain_verify_greedy(torch.tensor([1]), torch.tensor([0, 1]), torch.tensor([1, 2]),
                              backend="triton")


@pytest.mark.parametrize("call, match", [
    (lambda: K.chain_verify_greedy(torch.tensor([1]), torch.tensor([0, 1]), torch.tensor([1]),
                                   backend="torch"), "target_argmax"),
    (lambda: K.chain_verify_greedy(torch.tensor([1, 2]), torch.tensor([0, 2, 1]),
                                   torch.tensor([1, 2, 3, 4])), "cu_num_draft"),
    (lambda: K.chain_verify_greedy(torch.tensor([1.0]), torch.tensor([0, 1]),
                                   torch.tensor([1, 2])), "draft_ids"),
    (lambda: K.chain_verify_greedy(torch.tensor([1]), torch.tensor([0, 1]), torch.tensor([1, 2]),
                                   backend="cuda"), "backend"),
    (lambda: K.chain_verify_sampling(torch.tensor([7]), torch.tensor([0, 1]), torch.ones(2, 4),
                                     None, torch.zeros(1), torch.ones(2, 4)), "draft_ids"),
    (lambda: K.chain_verify_sampling(torch.tensor([1]), torch.tensor([0, 1]), torch.ones(2, 4),
                                     torch.ones(2, 4), torch.zeros(1), torch.ones(2, 4)),
     "draft_probs"),
    (lambda: K.tree_verify_greedy(torch.tensor([[0, 1]]), torch.tensor([[-1, 1]]),
                                  torch.tensor([[1, 1]])), "parents"),
    (lambda: K.tree_verify_greedy(torch.tensor([[0, 1]]), torch.tensor([[0, 0]]),
                                  torch.tensor([[1, 1]])), "parents"),
    (lambda: K.tree_verify_sampling(torch.tensor([[0, 2, 2]]), torch.tensor([[-1, 0, 0]]),
                                    torch.ones(1, 3, 4), torch.zeros(1, 3), torch.ones(1, 3, 4)),
     "distinct"),
    (lambda: K.tree_verify_sampling(torch.tensor([[0, 9]]), torch.tensor([[-1, 0]]),
                                    torch.ones(1, 2, 4), torch.zeros(1, 2), torch.ones(1, 2, 4)),
     "tree_tokens"),
])
def test_bad_inputs_raise(call, match):
    with pytest.raises(DraftlabError, match=match):
        call()


# ---------------------------------------------------------------------------------------------
# the fused decode layer (kernels/decode_layer.py) against torch's reference ops

def _decode_layer_kernels():
    from draftlab.kernels import decode_layer

    assert decode_layer.INTERPRETED != _CUDA, "the child runs the kernels in the wrong mode"
    return decode_layer


def _close(got, want, dtype):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = (got.double().cpu() - want.double().cpu()).norm() / want.double().norm().clamp_min(1e-12)
    assert err < tol, f"relative error {err:.2e} (tolerance {tol:.0e})"


def _dtypes():
    return (torch.float32, torch.bfloat16) if _CUDA else (torch.float32,)


def interp_add_rms_norm_and_silu_mul_match_reference():
    K = _decode_layer_kernels()
    dev = "cuda" if _CUDA else "cpu"
    gen = torch.Generator().manual_seed(0)
    for dtype in _dtypes():
        x, d = (torch.randn(3, 5, 72, generator=gen).to(dev, dtype) for _ in range(2))
        w = torch.rand(72, generator=gen).to(dev, dtype) + 0.5
        for delta in (None, d):
            s, y = K.add_rms_norm(x, delta, w, 1e-5)
            ref_s = x if delta is None else x + delta
            var = ref_s.float().pow(2).mean(-1, keepdim=True)
            ref_y = w * (ref_s.float() * torch.rsqrt(var + 1e-5)).to(dtype)
            _close(s, ref_s, dtype)
            _close(y, ref_y, dtype)
        gu = torch.randn(4, 2, 2 * 96, generator=gen).to(dev, dtype)
        g, u = gu.chunk(2, -1)
        _close(K.silu_mul(gu), torch.nn.functional.silu(g) * u, dtype)


def interp_rope_kv_write_matches_reference():
    from draftlab.models.layers import rope

    K = _decode_layer_kernels()
    dev = "cuda" if _CUDA else "cpu"
    gen = torch.Generator().manual_seed(1)
    B, T, NH, NKV, D, S = 3, 4, 6, 2, 16, 40
    for dtype in _dtypes():
        qkv = torch.randn(B, T, (NH + 2 * NKV) * D, generator=gen).to(dev, dtype)
        angle = torch.rand(B, T, D // 2, generator=gen).repeat(1, 1, 2) * 6
        cos, sin = angle.cos().to(dev, dtype), angle.sin().to(dev, dtype)
        slots = torch.stack([torch.randperm(S, generator=gen)[:T] for _ in range(B)]).to(dev)
        k_cache = torch.full((B, NKV, S, D), float("nan"), device=dev, dtype=dtype)
        v_cache = k_cache.clone()
        q = K.rope_kv_write(qkv, cos, sin, slots, k_cache, v_cache, NH, NKV)
        q_ref, k_ref, v_ref = qkv.view(B, T, NH + 2 * NKV, D).split([NH, NKV, NKV], 2)
        c, s_ = cos[:, :, None], sin[:, :, None]
        _close(q, rope(q_ref, c, s_), dtype)
        idx = slots[:, None, :, None].expand(B, NKV, T, D)
        _close(k_cache.gather(2, idx), rope(k_ref, c, s_).transpose(1, 2), dtype)
        _close(v_cache.gather(2, idx), v_ref.transpose(1, 2), dtype)
        written = torch.zeros(B, S, dtype=torch.bool, device=dev).scatter_(1, slots, True)
        assert k_cache[~written[:, None].expand(B, NKV, S)].isnan().all(), "a slot outside slots was written"


@pytest.mark.parametrize("split_slots", [256, 32])  # one program per row and head, or chunks merged
def interp_attention_matches_sdpa(monkeypatch, split_slots):
    K = _decode_layer_kernels()
    monkeypatch.setattr(K, "SPLIT_SLOTS", split_slots)
    dev = "cuda" if _CUDA else "cpu"
    gen = torch.Generator().manual_seed(2)
    NH, NKV, D, S = 6, 2, 16, 160
    for dtype in _dtypes():
        for B, T, lengths in ((1, 1, [0]), (3, 1, [5, 0, 130]), (2, 7, [70, 3]), (4, 12, [64, 1, 99, 140])):
            q = torch.randn(B, T, NH, D, generator=gen).to(dev, dtype)
            k, v = (torch.randn(B, NKV, S, D, generator=gen).to(dev, dtype) for _ in range(2))
            L = torch.tensor(lengths)[:, None]
            slots = (L + torch.arange(T)).to(dev)
            span = S if B % 2 else int(L.max()) + T  # a static cache's span, or the ragged one
            n = torch.arange(span)
            tree = torch.rand(B, T, T, generator=gen) < 0.5
            tree |= torch.eye(T, dtype=torch.bool)  # each input sees itself, and a random set of the others
            rel = n[None] - L
            inside = (rel >= 0) & (rel < T)
            mask = (n[None] < L)[:, None] | (inside[:, None] & tree.gather(2, rel.clamp(0, T - 1)[:, None].expand(-1, T, -1)))
            if B == 4:
                mask[1, 2, 0] = False  # a past slot hidden from one input (a tree grown in the cache)
            mask = mask.to(dev)
            out = K.attention(q, k, v, mask, slots, D ** -0.5)
            ref = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2).float(), k[:, :, :span].float(), v[:, :, :span].float(), attn_mask=mask[:, None],
                scale=D ** -0.5, enable_gqa=True).transpose(1, 2)
            _close(out, ref, dtype)


def interp_fused_target_decodes_as_the_reference_layer(tmp_path):
    """The whole target: decoding forwards through the fused layer equal the reference layer's
    (logits and hidden states, static and ragged caches, layers skipped), and the decoder's
    greedy tokens are the same both ways."""
    from tiny import make_tiny_target_dir

    from draftlab.inference.decoder import Decoder
    from draftlab.inference.ngram import NgramProposer
    from draftlab.inference.shapes import Chain
    from draftlab.models.target import Target

    _decode_layer_kernels()
    dev = "cuda" if _CUDA else "cpu"
    target = Target.load(str(make_tiny_target_dir(tmp_path / "llama")), device=dev)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (5, 17, 9)]
    ids = torch.randint(3, 300, (3, 4), generator=gen).to(dev)
    for static in (False, True):
        outs = {}
        for fused in (False, True):
            target.fused_decode = fused
            cache = target.new_cache(3, 64, ragged=True, static=static)
            for b, p in enumerate(prompts):  # prefill each row alone (the reference path both times)
                row = cache.row(b)
                target.forward(torch.tensor([p], device=dev), cache=row, logits=None)
                cache.lengths[b] = row.length
            tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool, device=dev)
            step1 = target.forward(ids, layers=[0, 2, 4], cache=cache, attn_mask=tree[None], logits="all")
            step2 = target.forward(ids[:, :1], layers=[3], cache=cache, logits="last", skip=(1,))
            outs[fused] = [step1.logits, *step1.hidden.values(), step2.logits, *step2.hidden.values()]
        for got, want in zip(outs[True], outs[False]):
            _close(got, want, torch.float32)
    runs = {}
    for fused in (False, True):
        target.fused_decode = fused
        plain = Decoder(target).generate(prompts, 12).rows
        spec = Decoder(target, NgramProposer(3, 1)).generate(prompts, 12, shape=Chain(3)).rows
        runs[fused] = [r.tokens for r in plain + spec]
    assert runs[True] == runs[False]


# ---------------------------------------------------------------------------------------------
# the child runs, interpreted and on CUDA (keep last: it exposes every interp_* defined above)

if _CHILD:  # expose the Triton checks as tests only inside a child run
    for _name, _fn in list(globals().items()):
        if _name.startswith("interp_") and callable(_fn):
            globals()["test_" + _name] = _fn


def _run_child(interpreted: bool) -> None:
    """Run this file's ``interp_*`` checks in a child pytest, under Triton's interpreter or on
    CUDA; assert they all ran and passed (the child's report is the failure message)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update({"DRAFTLAB_KERNELS_INTERP": "1", "TRITON_INTERPRET": "1"} if interpreted else
               {"DRAFTLAB_KERNELS_INTERP": "1", "DRAFTLAB_KERNELS_CUDA": "1"})
    res = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-k", "test_interp_", "-p", "no:cacheprovider",
         "--noconftest"],
        cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
        timeout=300)
    report = res.stdout[-6000:] + res.stderr[-2000:]
    assert res.returncode == 0, report
    summary = res.stdout.strip().splitlines()[-1]  # e.g. "19 passed, 27 deselected in 2.6s"
    expected = sum(1 for name in globals() if name.startswith("interp_"))
    match = re.search(r"(\d+) passed", summary)
    assert match and int(match.group(1)) >= expected, report
    assert not re.search(r"failed|error|skipped", summary), report


@pytest.mark.skipif(_CHILD, reason="this is the parent of the interpreter run")
def test_triton_kernels_under_interpreter():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    _run_child(interpreted=True)


@pytest.mark.skipif(_CHILD, reason="this is the parent of the CUDA run")
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_kernels_on_cuda():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    _run_child(interpreted=False)
