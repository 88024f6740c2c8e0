"""Online distillation of an EAGLE-3 drafter toward a moving policy (ReSpec, arXiv 2510.26475:
"evolving the drafter via knowledge distillation" and "weighting updates by rollout rewards").

Given a drafter checkpoint, the policy of one RL epoch and that epoch's rollouts (prompt ids,
response ids, reward), :func:`distill` runs one policy forward over each rollout (prompt +
response: the hidden states the drafter reads and the policy's next-token distributions), then
``steps`` AdamW steps of the drafter on all of those rollouts, and writes the updated drafter as a
draftlab checkpoint (safetensors + JSON, atomically). ReSpec's exact loss is not public; this
is the one used here, per training-time-test step s < S (EAGLE-3's unroll, ``ttt_steps``):

    L = sum_s decay^s * sum_i sum_{t in C_is} w_i KL(p_pi(.|t, s) || q_theta(.|t, s)) / sum_i w_i |C_is|

with C_is the positions whose step-s prediction is a response token of rollout i, p_pi the
policy's distribution restricted to the drafter's vocabulary (what EAGLE-3 trains on), and
w_i = 1 (``weighting="uniform"``, online KD) or w_i = r_i >= 0 (``"reward"``, reward-weighted KD).
The weights are normalised over the tokens they weigh, so scaling every reward by a constant
changes nothing, a rollout of reward 0 contributes nothing, and rewards all 0 make no update.
Both weightings read the same rollouts for the same steps: equal distillation compute.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from draftlab.errors import DraftlabError
from draftlab.inference.respec import Rollout

WEIGHTINGS = ("uniform", "reward")


@dataclass
class DistillSpec:
    steps: int = 8
    lr: float = 1e-4  # a fresh AdamW's first steps move every weight by about lr: 3e-4 overshot on SmolLM2-135M
    weighting: str = "uniform"
    ttt_steps: int | None = None  # default: what the checkpoint was trained with (its recipe's loss.ttt_steps)
    decay: float | None = None  # default: the checkpoint's loss.decay, else 0.8
    micro_tokens: int = 4096  # tokens per forward of the drafter (gradients accumulate over the epoch)
    clip_grad_norm: float = 0.5  # the trainer's default

    def check(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 0:
            raise DraftlabError(f"distillation steps must be an integer >= 0, got {self.steps!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise DraftlabError(f"distillation lr must be > 0, got {self.lr!r}")
        if self.weighting not in WEIGHTINGS:
            raise DraftlabError(f"distillation weighting must be one of {', '.join(WEIGHTINGS)}, got {self.weighting!r}")
        if self.ttt_steps is not None and (not isinstance(self.ttt_steps, int) or self.ttt_steps < 1):
            raise DraftlabError(f"distillation ttt_steps must be >= 1, got {self.ttt_steps!r}")
        if self.decay is not None and not self.decay > 0:
            raise DraftlabError(f"distillation decay must be > 0, got {self.decay!r}")
        if self.micro_tokens < 1:
            raise DraftlabError(f"distillation micro_tokens must be >= 1, got {self.micro_tokens!r}")


def weights(rollouts: list[Rollout], weighting: str) -> list[float]:
    """Each rollout's w_i before normalisation: 1, or its reward (>= 0, finite: else a one-line error)."""
    if weighting == "uniform":
        return [1.0] * len(rollouts)
    for i, r in enumerate(rollouts):
        if not (isinstance(r.reward, (int, float)) and math.isfinite(r.reward) and r.reward >= 0):
            raise DraftlabError(f"reward-weighted distillation needs finite rewards >= 0; rollout {i} has {r.reward!r}")
    return [float(r.reward) for r in rollouts]


def load(drafter_dir, policy):
    """(drafter in fp32, its checkpoint meta) next to ``policy``: an EAGLE-3 checkpoint trained for
    the policy's target (shape and vocabulary), else a one-line error."""
    from draftlab.checkpoint import load_drafter, read_meta

    algorithm = read_meta(drafter_dir)["algorithm"]
    if algorithm != "eagle3":
        raise DraftlabError(f"{drafter_dir}: an EAGLE-3 drafter checkpoint is needed, got algorithm {algorithm!r}")
    return load_drafter(drafter_dir, policy, dtype=torch.float32)


@dataclass
class _Micro:
    """A micro-batch: rollouts padded on the right, the policy's features and the targets the loss reads."""

    batch: dict
    hidden: dict
    w: torch.Tensor  # [B] the rollouts' weights
    targets: tuple  # drafter.compact_targets(...)


def _micro_batches(drafter, policy, rollouts: list[Rollout], w: list[float], micro_tokens: int) -> list[_Micro]:
    """One policy forward per rollout (its features at the drafter's layers and the last one),
    grouped into right-padded micro-batches of about ``micro_tokens`` tokens."""
    layers = sorted(set(drafter.capture_layers))
    seqs = []
    for r, wi in zip(rollouts, w):
        ids = torch.tensor([r.prompt + r.response], device=policy.device)
        hidden = policy(ids, layers=layers, logits=None).hidden  # one forward over the rollout
        seqs.append((ids[0], len(r.prompt), {k: v[0].float() for k, v in hidden.items()}, wi))
    groups, cur, width = [], [], 0
    for s in seqs:
        if cur and max(width, len(s[0])) * (len(cur) + 1) > micro_tokens:
            groups.append(cur)
            cur, width = [], 0
        cur.append(s)
        width = max(width, len(s[0]))
    if cur:
        groups.append(cur)
    out = []
    for g in groups:
        T = max(len(s[0]) for s in g)
        ids = torch.zeros(len(g), T, dtype=torch.long, device=policy.device)
        mask, attn = torch.zeros_like(ids, dtype=torch.bool), torch.zeros_like(ids)
        hidden = {k: torch.zeros(len(g), T, g[0][2][k].shape[-1], device=policy.device) for k in layers}
        for b, (row, plen, hid, _) in enumerate(g):
            ids[b, : len(row)], mask[b, plen : len(row)], attn[b, : len(row)] = row, True, 1
            for k in layers:
                hidden[k][b, : len(row)] = hid[k]
        batch = {"input_ids": ids, "loss_mask": mask, "attention_mask": attn}
        with torch.no_grad():
            targets = drafter.compact_targets(batch, hidden)
        out.append(_Micro(batch, hidden, torch.tensor([s[3] for s in g], device=policy.device), targets))
    return out


def _step_terms(drafter, m: _Micro, steps: int):
    """Per TTT step s: (sum over its counted positions of w_i * KL, sum of KL, how many)."""
    from draftlab.losses.eagle import distribution_loss

    ids, loss_mask = m.batch["input_ids"], m.batch["loss_mask"]
    B, T = ids.shape
    need, _, _, p = m.targets
    row = F.pad((need.flatten().cumsum(0) - 1).view(B, T), (0, steps + 1), value=-1)
    counted_all = F.pad(loss_mask, (0, steps + 2))
    entropy = -torch.special.xlogy(p, p).sum(-1)  # KL = soft cross-entropy - H(p): the same gradient
    wpos = m.w[:, None].expand(B, T)
    for s, h in drafter.unroll(ids, m.hidden, steps):
        counted = counted_all[:, 2 + s : 2 + s + T]  # step s at t predicts x_{t+2+s}: count response tokens
        r = row[:, 1 + s : 1 + s + T][counted]
        kl = distribution_loss(drafter.head(h[counted]), p[r]) - entropy[r]
        yield (wpos[counted] * kl).sum(), kl.detach().sum(), kl.numel()


@torch.no_grad()
def mean_kl(drafter, micro: list[_Micro], steps: int) -> list[float]:
    """Per TTT step, the unweighted mean KL(policy || drafter) over every rollout's counted positions."""
    drafter.eval()
    sums, counts = [0.0] * steps, [0] * steps
    for m in micro:
        for s, (_, kl, n) in enumerate(_step_terms(drafter, m, steps)):
            sums[s] += float(kl)
            counts[s] += n
    return [x / n if n else float("nan") for x, n in zip(sums, counts)]


def _recipe_section(meta: dict, key: str) -> dict:
    """A section of the recipe a checkpoint was trained with ({} when it names none)."""
    recipe = meta.get("recipe") if isinstance(meta.get("recipe"), dict) else {}
    return recipe.get(key) if isinstance(recipe.get(key), dict) else {}


def distill(drafter_dir, policy, rollouts: list[Rollout], out, spec: DistillSpec, log=None) -> dict:
    """``spec.steps`` steps of (reward-weighted) KD of the drafter at ``drafter_dir`` toward
    ``policy`` (a loaded :class:`~draftlab.models.target.Target` or a target spec) on ``rollouts``;
    the updated drafter written to ``out``. Returns what it did: steps, tokens, KL before and after."""
    from draftlab import atomic
    from draftlab import checkpoint as ckpt

    spec.check()
    if not rollouts:
        raise DraftlabError("distillation needs at least one rollout")
    w = weights(rollouts, spec.weighting)
    if isinstance(policy, (str, Path)):
        from draftlab.models.target import Target

        policy = Target.load(str(policy), dtype="float32")
    t0 = time.perf_counter()
    drafter, meta = load(drafter_dir, policy)
    loss_cfg, drafter_cfg = _recipe_section(meta, "loss"), _recipe_section(meta, "drafter")
    S = spec.ttt_steps or drafter.trained_depth(loss_cfg) or 1
    decay = spec.decay or float(loss_cfg.get("decay", 0.8))
    if drafter_cfg.get("freeze_lm_head"):  # trained with the target's lm_head rows kept: keep them
        drafter.lm_head.weight.requires_grad_(False)
    micro = _micro_batches(drafter, policy, rollouts, w, spec.micro_tokens)
    # the normalisers: per step, the weights of every counted position of the epoch
    with torch.no_grad():
        denom = [0.0] * S
        for m in micro:
            ids = m.batch["input_ids"]
            for s in range(S):
                counted = F.pad(m.batch["loss_mask"], (0, S + 2))[:, 2 + s : 2 + s + ids.shape[1]]
                denom[s] += float((m.w[:, None] * counted).sum())
    tokens = sum(len(r.prompt) + len(r.response) for r in rollouts)
    kl_before = mean_kl(drafter, micro, S)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.0)
    done, losses = 0, []
    if denom[0] > 0:  # rewards all 0 (or no response token): nothing to learn, no update
        drafter.train()
        for _ in range(spec.steps):
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for m in micro:  # gradients accumulate over the epoch's micro-batches: one step sees every rollout
                loss = sum(decay**s * wkl / denom[s] for s, (wkl, _, _) in enumerate(_step_terms(drafter, m, S)) if denom[s] > 0)
                loss.backward()
                total += float(loss.detach())
            torch.nn.utils.clip_grad_norm_(params, spec.clip_grad_norm)
            opt.step()
            done += 1
            losses.append(total)
            if log:
                log(f"distill step {done}/{spec.steps}: loss {total:.4f}")
    kl_after = mean_kl(drafter, micro, S) if done else kl_before
    report = {
        "weighting": spec.weighting, "steps": done, "steps_asked": spec.steps, "lr": spec.lr, "ttt_steps": S, "decay": decay,
        "rollouts": len(rollouts), "tokens": tokens, "policy_forwards": len(rollouts), "micro_batches": len(micro),
        "drafter_passes": done * len(micro),  # forward + backward over a micro-batch
        "weight_sum": sum(w), "kl_before": kl_before, "kl_after": kl_after, "losses": losses,
        "seconds": time.perf_counter() - t0, "source": str(drafter_dir),
    }
    metrics = {**(meta.get("metrics") or {}), "online_distill": report}
    with atomic.directory(out) as tmp:
        ckpt.save_weights(tmp, drafter.state_dict(), ckpt.checkpoint_meta(
            drafter, policy.identity, meta.get("recipe"), int(meta.get("step") or 0) + done, metrics, meta.get("precision")))
    return report
