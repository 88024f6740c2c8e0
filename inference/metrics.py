"""The one definition of acceptance metrics (methods.md), used by the decoder, ``draftlab eval``,
training-time evaluation, benchmarks and model cards.

Over verify steps (one target forward each), with L = number of drafts accepted in a step
(for trees: the accepted depth):

* ``a_j = P(L >= j)``, j = 1..K (unconditional per-position acceptance; vLLM's
  ``num_accepted_tokens_per_pos[j] / num_drafts``);
* ``alpha_j = a_j / a_{j-1}`` with ``a_0 = 1`` (conditional acceptance, EAGLE's n-alpha); None
  where ``a_{j-1} = 0`` (undefined: no step ever reached position j);
* ``tau = 1 + sum_j a_j`` = mean tokens emitted per verify step, bonus/correction included.

K is the largest draft depth any step offered (chain: drafts proposed; tree: tree depth).
Steps that offered fewer drafts (a prompt-lookup miss, say) count with L = 0 beyond what they
offered, which keeps ``tau`` equal to tokens per target forward.

The engines count tau two ways, and a report gives both (:data:`TAU_LABELS`): ``tau`` pooled
over every verify step of every prompt (vLLM's mean acceptance length, 1 + accepted / drafts),
and ``tau_prompt_mean``, the mean of each prompt's own tau (SpecForge's benchmarks). They differ
when prompts take different numbers of steps: a prompt that accepts little takes more steps,
so it weighs more in the pooled tau, which is then the lower of the two.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AcceptanceStats:
    num_steps: int = 0
    reached: list[int] = field(default_factory=list)  # reached[j-1] = #steps with L >= j
    offered: list[int] = field(default_factory=list)  # offered[j-1] = #steps offering a depth-j draft
    num_drafted: int = 0  # draft tokens (tree nodes) sent to the verifier
    num_accepted: int = 0  # sum of L

    def add(self, accepted: int, drafted: int, depth: int | None = None) -> None:
        """One verify step: ``accepted`` drafts accepted (tree: accepted depth), ``drafted``
        tokens verified, ``depth`` = the longest acceptable run offered (defaults to ``drafted``,
        right for chains; the tree depth for trees)."""
        depth = drafted if depth is None else depth
        if not 0 <= accepted <= depth or drafted < 0:
            raise ValueError(f"acceptance step: accepted={accepted} must lie in 0..depth={depth}")
        self._grow(depth)
        for j in range(accepted):
            self.reached[j] += 1
        for j in range(depth):
            self.offered[j] += 1
        self.num_steps += 1
        self.num_drafted += drafted
        self.num_accepted += accepted

    def add_many(self, accept_lengths, num_drafted, depths=None) -> None:
        depths = depths if depths is not None else [None] * len(accept_lengths)
        for a, d, k in zip(accept_lengths, num_drafted, depths, strict=True):
            self.add(a, d, k)

    def merge(self, other: "AcceptanceStats") -> "AcceptanceStats":
        """In place; returns self."""
        self._grow(other.k)
        for j in range(other.k):
            self.reached[j] += other.reached[j]
            self.offered[j] += other.offered[j]
        self.num_steps += other.num_steps
        self.num_drafted += other.num_drafted
        self.num_accepted += other.num_accepted
        return self

    def _grow(self, k: int) -> None:
        while len(self.reached) < k:
            self.reached.append(0)
            self.offered.append(0)

    @property
    def k(self) -> int:
        return len(self.reached)

    @property
    def a(self) -> list[float]:
        if self.num_steps == 0:
            return [0.0] * self.k
        return [r / self.num_steps for r in self.reached]

    @property
    def alpha(self) -> list[float | None]:
        out: list[float | None] = []
        prev = 1.0 if self.num_steps else 0.0
        for a_j in self.a:
            out.append(a_j / prev if prev > 0 else None)
            prev = a_j
        return out

    @property
    def tau(self) -> float:
        """Mean tokens per verify step (0 steps -> 1.0: every forward emits one token)."""
        return 1.0 + sum(self.a)

    def to_dict(self) -> dict:
        return {
            "tau": self.tau,
            "a": self.a,
            "alpha": self.alpha,
            "num_steps": self.num_steps,
            "mean_accepted": self.num_accepted / self.num_steps if self.num_steps else 0.0,
            "num_drafted": self.num_drafted,
            "num_accepted": self.num_accepted,
            # vLLM's "draft acceptance rate" (accepted / drafted): NOT alpha, reported for comparison.
            "accepted_per_drafted": self.num_accepted / self.num_drafted if self.num_drafted else 0.0,
            "reached": list(self.reached),
            "offered": list(self.offered),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "AcceptanceStats":
        return cls(
            num_steps=int(d["num_steps"]),
            reached=[int(x) for x in d["reached"]],
            offered=[int(x) for x in d["offered"]],
            num_drafted=int(d["num_drafted"]),
            num_accepted=int(d["num_accepted"]),
        )


TAU_LABELS = {
    "tau": "τ pooled over all steps (vLLM)",
    "tau_prompt_mean": "τ mean of per-prompt τ (SpecForge)",
}


def tau_prompt_mean(per_prompt: list[AcceptanceStats]) -> float | None:
    """SpecForge's tau: the mean over prompts of each prompt's own tau (None with no prompts)."""
    return sum(s.tau for s in per_prompt) / len(per_prompt) if per_prompt else None


def tau_standard_error(per_prompt: list[AcceptanceStats]) -> float | None:
    """One standard error of the pooled tau, prompts as the sampled units (a prompt's steps are not
    independent: one that accepts little does so at every step). Pooled tau is a ratio of sums over
    prompts, sum(emitted_i) / sum(steps_i); its delta-method variance is n/(n-1) * sum(z_i^2) /
    sum(steps_i)^2 with z_i = emitted_i - tau * steps_i. None with fewer than 2 prompts."""
    steps = [s.num_steps for s in per_prompt]
    total = sum(steps)
    if len(per_prompt) < 2 or total == 0:
        return None
    tau = sum(s.tau * s.num_steps for s in per_prompt) / total
    z2 = sum((s.tau - tau) ** 2 * s.num_steps**2 for s in per_prompt)
    n = len(per_prompt)
    return (n / (n - 1) * z2) ** 0.5 / total


def acceptance_stats(accept_lengths, k) -> AcceptanceStats:
    """Stats of per-step accepted counts where every step offered ``k`` drafts (an int) or
    ``k[i]`` drafts at step i (a list)."""
    accept_lengths = list(accept_lengths)
    ks = [k] * len(accept_lengths) if isinstance(k, int) else list(k)
    s = AcceptanceStats()
    s.add_many(accept_lengths, ks)
    return s
