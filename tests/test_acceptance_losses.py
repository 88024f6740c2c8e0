"""The LK acceptance losses (losses/acceptance.py) against brute-force references: alpha = 1 - TV,
values by hand, gradients (finite differences for nla; lambda held constant for lk_hybrid), the
closed form the draft LM uses, masks and out-of-vocabulary slots in each family's reduction, and
every family that compares distributions training with them (the draft LM's are in
test_draft_lm.py, which runs every loss kind)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from draftlab.losses import acceptance as A
from draftlab.losses import diffusion as D
from draftlab.losses.eagle import eagle3_step_loss
from draftlab.losses.medusa import data_loss, distill_loss
from tiny import final_hidden, padded_batch, random_samples

D64 = torch.float64
pytestmark = pytest.mark.usefixtures("one_thread")


def _random(n=5, v=7, seed=0, zeros=True):
    """Draft logits [n, v] and target probabilities [n, v] with some exact zeros in p."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g, dtype=D64) * 2
    p = torch.softmax(torch.randn(n, v, generator=g, dtype=D64) * 2, -1)
    if zeros:
        p[:, 0] = 0
        p = p / p.sum(-1, keepdim=True)
    return logits, p


def _brute(kind, logits, p, eta):
    """The definitions one position at a time in plain Python floats."""
    out = []
    for z, pr in zip(logits.tolist(), p.tolist()):
        m = max(z)
        e = [math.exp(x - m) for x in z]
        q = [x / sum(e) for x in e]
        alpha = sum(min(a, b) for a, b in zip(pr, q))
        kl = sum(a * math.log(a / b) for a, b in zip(pr, q) if a > 0)
        lam = math.exp(-eta * alpha)
        out.append(-math.log(alpha) if kind == "nla" else lam * kl + (1 - lam) * (1 - alpha))
    return torch.tensor(out, dtype=D64)


def test_alpha_is_one_minus_tv_and_kl_by_brute_force():
    logits, p = _random()
    q = torch.softmax(logits, -1)
    log_alpha, kl = A.distribution_alpha_kl(F.log_softmax(logits, -1), p)
    torch.testing.assert_close(log_alpha.exp(), 1 - 0.5 * (p - q).abs().sum(-1))
    want_kl = [sum(a * math.log(a / b) for a, b in zip(pr, qr) if a > 0) for pr, qr in zip(p.tolist(), q.tolist())]
    torch.testing.assert_close(kl, torch.tensor(want_kl, dtype=D64))
    torch.testing.assert_close(A.entropy(p), -(p * p.log()).nan_to_num().sum(-1))
    # q == p accepts everything; disjoint supports accept nothing, with a finite loss
    same, _ = A.distribution_alpha_kl(p.log(), p)
    torch.testing.assert_close(same, torch.zeros(5, dtype=D64))
    disjoint, _ = A.distribution_alpha_kl(torch.tensor([[0.0, -1e4]], dtype=D64), torch.tensor([[0.0, 1.0]], dtype=D64))
    assert torch.isfinite(A.lk_loss("nla", disjoint, torch.zeros(1))).all()


def test_values_by_hand():
    p = torch.tensor([[0.5, 0.3, 0.2]], dtype=D64)
    logq = torch.tensor([[0.2, 0.3, 0.5]], dtype=D64).log()
    la, kl = A.distribution_alpha_kl(logq, p)
    alpha = 0.2 + 0.3 + 0.2
    want_kl = 0.5 * math.log(0.5 / 0.2) + 0.2 * math.log(0.2 / 0.5)
    assert la.exp().item() == pytest.approx(alpha) and kl.item() == pytest.approx(want_kl)
    assert A.lk_loss("nla", la, kl).item() == pytest.approx(-math.log(alpha))
    lam = math.exp(-3.0 * alpha)
    assert A.lk_loss("lk_hybrid", la, kl).item() == pytest.approx(lam * want_kl + (1 - lam) * (1 - alpha))
    lam = math.exp(-0.5 * alpha)
    assert A.lk_loss("lk_hybrid", la, kl, eta=0.5).item() == pytest.approx(lam * want_kl + (1 - lam) * (1 - alpha))
    with pytest.raises(ValueError, match="unknown acceptance loss 'tv'"):
        A.lk_loss("tv", la, kl)


@pytest.mark.parametrize("kind", A.KINDS)
@pytest.mark.parametrize("eta", [3.0, 0.4])
def test_loss_and_gradient_equal_the_brute_force_reference(kind, eta):
    logits, p = _random(seed=1)
    z = logits.clone().requires_grad_()
    loss = A.lk_distribution_loss(kind, z, p, eta)
    torch.testing.assert_close(loss.double(), _brute(kind, logits, p, eta))
    (grad,) = torch.autograd.grad(loss.sum(), z)

    def reference(s, lam):
        """alpha through TV, KL through logs, lambda a constant: no gradient reaches it."""
        q = torch.softmax(s, -1)
        alpha = 1 - 0.5 * (p - q).abs().sum(-1)
        if kind == "nla":
            return -alpha.log()
        kl = (torch.where(p > 0, p * (p.clamp_min(1e-300).log() - q.log()), 0.0)).sum(-1)
        return lam * kl + (1 - lam) * (1 - alpha)

    lam = torch.exp(-eta * (1 - 0.5 * (p - torch.softmax(logits, -1)).abs().sum(-1)))
    s = logits.clone().requires_grad_()
    (want,) = torch.autograd.grad(reference(s, lam).sum(), s)
    torch.testing.assert_close(grad.double(), want)
    # finite differences of the reference at fixed lambda (nla has none to hold)
    assert torch.autograd.gradcheck(lambda s: reference(s, lam), (logits.clone().requires_grad_(),))
    # the draft LM's closed form
    lp, lq = p.log(), F.log_softmax(logits, -1)
    closed, closed_grad = A.lk_and_grad(kind, lp, lq, eta)
    torch.testing.assert_close(closed, loss.double())
    torch.testing.assert_close(closed_grad, grad.double())


def test_hybrid_weight_moves_from_kl_to_acceptance():
    """lambda = exp(-eta alpha): near 1 (the KL) while alpha is small or eta small, near 0 (1 - alpha)
    once alpha is large and eta large."""
    logits, p = _random(n=1, seed=2, zeros=False)
    la, kl = A.distribution_alpha_kl(F.log_softmax(logits, -1), p)
    alpha = la.exp()
    torch.testing.assert_close(A.lk_loss("lk_hybrid", la, kl, eta=1e-9), kl)
    torch.testing.assert_close(A.lk_loss("lk_hybrid", la, kl, eta=1e9), 1 - alpha)


def test_one_hot_targets_alpha_is_q_of_the_token():
    """A greedy or data token y as the target: alpha = q_y, KL = CE = -log q_y; nla is the CE."""
    logits, _ = _random(seed=3)
    y = torch.tensor([0, 3, 6, 2, 1])
    onehot = F.one_hot(y, 7).to(D64)
    la, kl = A.distribution_alpha_kl(F.log_softmax(logits, -1), onehot)
    ce = F.cross_entropy(logits, y, reduction="none")
    torch.testing.assert_close(la, -ce)
    torch.testing.assert_close(kl, ce)
    assert data_loss(logits, y, "nla").item() == pytest.approx(data_loss(logits, y).item())
    torch.testing.assert_close(data_loss(logits, y, "lk_hybrid", 2.0).double(), A.lk_loss("lk_hybrid", -ce, ce, 2.0).mean(),
                               rtol=1e-5, atol=1e-6)  # Medusa's loss runs in float32


def test_masks_and_reductions_of_each_family():
    logits, p = _random(n=6, seed=4)
    # EAGLE-3: the mean over counted positions only; an uncounted row gets no gradient
    mask = torch.tensor([True, False, True, True, False, True])
    z = logits.clone().requires_grad_()
    loss = eagle3_step_loss(z, p, mask, kind="nla")
    assert loss.item() == pytest.approx(_brute("nla", logits, p, 3.0)[mask].mean().item())
    (g,) = torch.autograd.grad(loss, z)
    assert (g[~mask] == 0).all() and (g[mask].abs().sum(-1) > 0).all()
    # Medusa: the mean over the rows it is given
    assert distill_loss(logits, p, "lk_hybrid", 1.5).item() == pytest.approx(_brute("lk_hybrid", logits, p, 1.5).mean().item())
    # diffusion: ce's position weights over counted slots / blocks with a counted slot; an
    # out-of-vocabulary token (-inf log q) is left out with a zero gradient, never NaN
    z = logits.view(2, 3, 7).clone().requires_grad_()
    labels = torch.tensor([[1, -1, 2], [4, 5, 6]])
    counted = torch.tensor([[True, True, True], [True, True, False]])
    for kind in A.KINDS:
        la, ce = D.token_terms(z, labels)
        loss = D.block_loss(kind, la, ce, counted, gamma=2.0, alpha=0.5, eta=3.0)
        per = A.lk_loss(kind, la.detach(), ce.detach())
        w = torch.exp(-torch.arange(3, dtype=D64) / 2.0)
        keep = counted & torch.isfinite(per)
        assert loss.item() == pytest.approx(float((w * per.nan_to_num(posinf=0.0) * keep).sum() / 2))
        (g,) = torch.autograd.grad(loss, z)
        assert torch.isfinite(g).all() and (g[0, 1] == 0).all() and (g[1, 2] == 0).all() and (g[0, 0] != 0).any()


# ---------------------------------------------------------------------------- families
def _eagle3(t, kind):
    from draftlab.models.eagle import Eagle3Config, Eagle3Drafter, Eagle3Loss

    return Eagle3Drafter.build(Eagle3Config(draft_vocab_size=64), t, random_samples(t)), Eagle3Loss(kind=kind, ttt_steps=2, eta=2.0)


def _eagle1(t, kind):
    from draftlab.models.eagle import Eagle1Config, Eagle1Drafter, Eagle1Loss

    return Eagle1Drafter.build(Eagle1Config(), t), Eagle1Loss(kind=kind, ce_weight=1.0)


def _medusa(t, kind, targets="target"):
    from draftlab.models.medusa import MedusaConfig, MedusaDrafter, MedusaLoss

    d = MedusaDrafter.build(MedusaConfig(num_heads=2, num_layers=1, draft_vocab_size=64), t, random_samples(t, n=6))
    return d, MedusaLoss(kind=kind, targets=targets)


def _diffusion(t, kind, targets="distribution"):
    from draftlab.models.diffusion import DiffusionConfig, DiffusionDrafter, DiffusionLoss

    d = DiffusionDrafter.build(DiffusionConfig(num_layers=1, block_size=4, target_layers=[1, 3], draft_vocab_size=64), t,
                               random_samples(t, n=6, T=40))
    return d, DiffusionLoss(kind=kind, targets=targets, anchors=4)


FAMILIES = {
    "eagle3": _eagle3, "eagle1": _eagle1, "medusa": _medusa, "medusa-data": lambda t, k: _medusa(t, k, "data"),
    "diffusion": _diffusion, "diffusion-greedy": lambda t, k: _diffusion(t, k, "greedy"),
}


@pytest.mark.parametrize("kind", A.KINDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_distribution_family_trains_with_the_lk_losses(tiny_llama, family, kind):
    t = tiny_llama
    torch.manual_seed(0)
    d, cfg = FAMILIES[family](t, kind)
    d.train()
    _, batch = padded_batch(t, 16, 11)
    hidden = t(batch["input_ids"], layers=d.capture_layers, logits=None).hidden
    batch = {**batch, **d.derived_targets(hidden, batch)} if hasattr(d, "derived_targets") else batch
    opt = torch.optim.Adam(d.parameters(), lr=1e-2)
    losses = []
    for _ in range(6):
        torch.manual_seed(1)  # the diffusion drafter's anchors: the same blocks every step
        loss, _ = d.training_loss(batch, hidden, cfg)
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in d.parameters() if p.grad is not None)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    # the kind is what ran: the first loss differs from the default's on the same weights, except
    # nla against one-hot targets, which is the cross-entropy
    fresh, default = FAMILIES[family](t, kind)[0], FAMILIES[family](t, "ce")[1]
    torch.manual_seed(1)
    with torch.no_grad():
        a, _ = fresh.training_loss(batch, hidden, cfg)
        torch.manual_seed(1)
        b, _ = fresh.training_loss(batch, hidden, default)
    one_hot = family in ("medusa-data", "diffusion-greedy")
    assert bool(torch.isclose(a, b)) == (one_hot and kind == "nla")


def test_loss_sections_take_kind_and_eta():
    from draftlab.losses.draft_lm import DraftLMLoss
    from draftlab.models.diffusion import DiffusionLoss
    from draftlab.models.eagle import Eagle1Loss, Eagle3Loss
    from draftlab.models.medusa import MedusaLoss
    from draftlab.models.medusa2 import Medusa2Loss

    for cls in (Eagle3Loss, Eagle1Loss, MedusaLoss, Medusa2Loss, DiffusionLoss, DraftLMLoss):
        assert cls(kind="lk_hybrid", eta=0.5).eta == 0.5 and cls().eta == A.ETA
        with pytest.raises(ValidationError, match="eta"):
            cls(kind="nla", eta=0)
    assert Eagle3Loss().kind == MedusaLoss().kind == DiffusionLoss().kind == "ce" and DraftLMLoss().kind == "fkl"
