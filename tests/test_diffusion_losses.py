"""Block-diffusion losses against hand-computed values: weights, token/distribution terms, the
four block losses, E[streak] and its gradient, stop-gradients, and NaN-free -inf/+inf inputs."""

from __future__ import annotations

import math

import pytest
import torch

from draftlab.losses import diffusion as D

D64 = torch.float64
INF = float("inf")


def t(x, dtype=D64):
    return torch.tensor(x, dtype=dtype)


def mask(*rows):
    return torch.tensor(rows, dtype=torch.bool)  # one row per block


A = t([0.5, 0.4, 0.9])  # E[streak] = 0.5 + 0.2 + 0.18 = 0.88
CE = t([1.0, 2.0, 3.0])


def test_position_weights():
    w = D.position_weights(4, 2.0)
    assert torch.allclose(w, torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0), math.exp(-1.5)]))


def test_token_terms_match_explicit_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=g, dtype=D64, requires_grad=True)
    labels = torch.tensor([[0, 4, -1], [2, -1, 1]])
    la, ce = D.token_terms(logits, labels, temperature=2.0)
    q = torch.softmax(logits.detach() / 2.0, -1)
    for n, j in [(0, 0), (0, 1), (1, 0), (1, 2)]:
        assert la[n, j].item() == pytest.approx(math.log(q[n, j, labels[n, j]].item()))
        assert ce[n, j].item() == pytest.approx(-la[n, j].item())
    assert la[0, 2] == -INF and la[1, 1] == -INF and ce[0, 2] == INF
    # an out-of-vocab slot must not poison the gradient of the others
    loss = D.weighted_ce_loss(ce, mask([True] * 3, [True] * 3), torch.ones(3))
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.isfinite(grad).all() and (grad[0, 2] == 0).all() and grad[0, 0].abs().sum() > 0


def test_distribution_terms_by_hand():
    p = t([[[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]]])  # [1, 2, 3]
    q = t([0.2, 0.3, 0.5])
    logits = torch.stack([q.log(), p[0, 1].log()]).unsqueeze(0)  # second slot: q == p
    la, ce = D.distribution_terms(logits, p)
    assert la[0, 0].exp().item() == pytest.approx(0.2 + 0.3 + 0.2)
    assert la[0, 1].item() == pytest.approx(0.0, abs=1e-12)
    want_ce = -(0.5 * math.log(0.2) + 0.3 * math.log(0.3) + 0.2 * math.log(0.5))
    assert ce[0, 0].item() == pytest.approx(want_ce)


def test_distribution_terms_disjoint_support_finite():
    logits = t([[[0.0, -300.0]]]).requires_grad_()
    la, ce = D.distribution_terms(logits, t([[[0.0, 1.0]]]))
    assert la.item() == pytest.approx(math.log(1e-30))
    (grad,) = torch.autograd.grad(la.sum() + ce.sum(), logits)
    assert torch.isfinite(grad).all()


def test_weighted_ce_loss():
    w = D.position_weights(3, 2.0).double()
    ce = t([[1.0, 2.0, 3.0], [4.0, INF, 6.0], [7.0, 8.0, 9.0]])
    m = mask([True, False, True], [True, True, True], [False, False, False])
    # the +inf is dropped; the third block has nothing counted so N_b = 2
    want = ((1 + 3 * math.exp(-1.0)) + (4 + 6 * math.exp(-1.0))) / 2
    assert D.weighted_ce_loss(ce, m, w).item() == pytest.approx(want)


def test_expected_streak_and_streak_loss():
    la = torch.stack([A, A, A]).log()
    m = mask([True] * 3, [True, False, True], [False, True, True])
    assert D.expected_streak(la, m).tolist() == pytest.approx([0.88, 0.5, 0.0])
    # the third block's streak is empty: it is not counted in N_b
    assert D.streak_loss(la, m).item() == pytest.approx(-(0.88 + 0.5) / 2)


def test_streak_gradient_is_suffix_sum_of_products():
    la = torch.stack([A, A]).log().requires_grad_()
    e = D.expected_streak(la, mask([True] * 3, [True, False, True]))
    (grad,) = torch.autograd.grad(e.sum(), la)
    assert grad[0].tolist() == pytest.approx([0.88, 0.38, 0.18])
    assert grad[1].tolist() == pytest.approx([0.5, 0.0, 0.0])


def test_ce_streak_values_and_stop_gradient():
    la = A.log().unsqueeze(0).requires_grad_()
    ce = CE.unsqueeze(0).requires_grad_()
    loss = D.ce_streak_loss(la, ce, mask([True] * 3))
    assert loss.item() == pytest.approx(1 * 1 + 0.5 * 2 + 0.2 * 3)
    g_la, g_ce = torch.autograd.grad(loss, (la, ce), allow_unused=True)
    assert g_la is None  # the prefix product is a stop-gradient
    assert g_ce[0].tolist() == pytest.approx([1.0, 0.5, 0.2])
    # prefix masking and a dropped +inf ce
    la2, ce2 = torch.stack([A, A]).log(), t([[1.0, 2.0, 3.0], [INF, 2.0, 3.0]])
    got = D.ce_streak_loss(la2, ce2, mask([True, False, True], [True, True, True]))
    assert got.item() == pytest.approx((1.0 + (0.5 * 2 + 0.2 * 3)) / 2)


def test_dpace_weights_and_loss():
    la = A.log().unsqueeze(0).requires_grad_()
    prods = [0.75, 0.75 * 0.7, 0.75 * 0.7 * 0.95]  # smoothed a = 0.5 a + 0.5 = [0.75, 0.7, 0.95]
    want_w = [sum(prods), prods[1] + prods[2], prods[2]]
    assert D.dpace_weights(la, mask([True] * 3)).squeeze(0).tolist() == pytest.approx(want_w)
    loss = D.dpace_loss(la, CE.unsqueeze(0).requires_grad_(), mask([True] * 3), alpha=0.5)
    assert loss.item() == pytest.approx(sum(w * c for w, c in zip(want_w, [1.0, 2.0, 3.0])))
    (g_la,) = torch.autograd.grad(loss, la, allow_unused=True)
    assert g_la is None  # weights are detached
    # a slot after an uncounted one has weight 0
    w = D.dpace_weights(A.log().unsqueeze(0), mask([True, False, True]))
    assert w.squeeze(0).tolist() == pytest.approx([0.75, 0.0, 0.0])


@pytest.mark.parametrize("kind", D.LOSSES)
def test_inf_inputs_give_finite_loss_and_gradients(kind):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, 6, generator=g, requires_grad=True)
    labels = torch.tensor([[1, -1, 2, 3], [-1, 0, 0, 0], [5, 4, -1, -1]])
    m = mask([True] * 4, [True] * 4, [True, True, True, False])
    la, ce = D.token_terms(logits, labels)
    loss = D.block_loss(kind, la, ce, m, gamma=4.0, alpha=0.5)
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and grad.abs().sum() > 0
    # leaf inputs holding the infinities directly
    la_leaf = la.detach().requires_grad_()
    ce_leaf = ce.detach().requires_grad_()
    loss = D.block_loss(kind, la_leaf, ce_leaf, m, gamma=4.0, alpha=0.5)
    grads = torch.autograd.grad(loss, (la_leaf, ce_leaf), allow_unused=True)
    assert torch.isfinite(loss) and all(gr is None or torch.isfinite(gr).all() for gr in grads)


@pytest.mark.parametrize("dtype", [torch.float32, D64])
def test_long_block_tiny_probabilities_stay_finite(dtype):
    la = torch.full((2, 64), -50.0, dtype=dtype, requires_grad=True)
    ce = torch.full((2, 64), 50.0, dtype=dtype)
    m = torch.ones(2, 64, dtype=torch.bool)
    e = D.expected_streak(la, m)
    assert e.tolist() == pytest.approx([math.exp(-50)] * 2, rel=1e-5)
    for kind in D.LOSSES:
        loss = D.block_loss(kind, la, ce, m, gamma=7.0, alpha=0.5)
        assert torch.isfinite(loss), kind
        if kind == "streak":
            (grad,) = torch.autograd.grad(loss, la)
            assert torch.isfinite(grad).all()
            assert grad[0, 0].item() == pytest.approx(-math.exp(-50) / 2, rel=1e-5)
    # ce_streak: weights exp(-50 (j-1)) -> only the first two slots carry visible weight
    assert D.ce_streak_loss(la, ce, m).item() == pytest.approx(50 * (1 + math.exp(-50)), rel=1e-5)


def test_block_loss_dispatch():
    la, ce = torch.stack([A, A]).log(), torch.stack([CE, CE])
    m = mask([True] * 3, [True, False, True])

    def run(kind, gamma=3.0):
        return D.block_loss(kind, la, ce, m, gamma=gamma, alpha=0.3).item()

    assert run("ce") == pytest.approx(D.weighted_ce_loss(ce, m, D.position_weights(3, 3.0)).item())
    assert run("ce") != pytest.approx(run("ce", gamma=1.0))
    assert run("streak") == pytest.approx(D.streak_loss(la, m).item())
    assert run("ce_streak") == pytest.approx(D.ce_streak_loss(la, ce, m).item())
    assert run("dpace") == pytest.approx(D.dpace_loss(la, ce, m, alpha=0.3).item())
    assert run("dpace") != pytest.approx(D.dpace_loss(la, ce, m, alpha=0.9).item())
    with pytest.raises(ValueError, match="'bogus'"):
        D.block_loss("bogus", la, ce, m, gamma=3.0, alpha=0.3)
