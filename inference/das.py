"""DAS's drafter (distribution-aware speculative decoding, arXiv 2511.13841): suffix tries over
recent rollouts, for RL workloads that sample the same prompts epoch after epoch.

* :class:`RolloutHistory` holds the rollouts of the last ``window`` epochs in suffix tries
  (:class:`~draftlab.inference.suffix.SuffixTrie`): one per problem (``scope="problem"``, DAS),
  or one for every problem (``"global"``, the ablation DAS compares against). A prefix trie over
  the prompts' token ids (:class:`PrefixRouter`) routes a rollout to its problem. A rollout's
  tokens go into its trie as they are verified (:meth:`RolloutHistory.extend`), so a problem's
  n samples draft from each other within an epoch; at the start of epoch e the rollouts of
  epochs <= e - window are taken out again (:meth:`SuffixTrie.remove`).
* :class:`DASProposer` drafts like ``--drafter suffix`` (the longest suffix match, then the most
  frequent continuation, :class:`~draftlab.inference.suffix.SuffixProposer`) with its problem's
  trie as the corpus, and caps each draft at the length-aware budget's k, if it has one
  (:mod:`~draftlab.inference.das_budget`): a short request drafts nothing.

Drafts are point masses, so verification stays lossless (greedy equals plain decoding; sampled
rollouts follow the policy) whatever the history holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftlab.device import device_ints
from draftlab.errors import DraftlabError
from draftlab.inference.shapes import Chain, ChainDraft
from draftlab.inference.suffix import SuffixProposer, SuffixTrie

SCOPES = ("problem", "global")
_END = -1  # the router's key for "a prompt ends here" (token ids are >= 0)


class PrefixRouter:
    """Prompt token ids -> a problem number, through a trie over the prompts: prompts sharing a
    chat template's header share its nodes, and a lookup reads each prompt token once."""

    def __init__(self):
        self.root: dict = {}
        self.count = 0

    def route(self, prompt_ids: list[int]) -> int:
        node = self.root
        for tok in prompt_ids:
            node = node.setdefault(tok, {})
        if _END not in node:
            node[_END], self.count = self.count, self.count + 1
        return node[_END]


@dataclass
class _Stream:
    """One rollout as inserted: the prompt's tail, then the response tokens verified so far."""

    epoch: int
    trie: SuffixTrie
    tokens: list[int]
    start: int  # where the response begins in ``tokens``
    live: list = field(default_factory=list)
    closed: bool = False

    @property
    def response(self) -> list[int]:
        return self.tokens[self.start :]


@dataclass
class _Problem:
    trie: SuffixTrie  # shared by every problem under the global scope
    streams: list[_Stream] = field(default_factory=list)  # oldest first
    lengths: list[tuple[int, int]] = field(default_factory=list)  # (epoch, response length) of closed rollouts


class RolloutHistory:
    """The rollouts of the last ``window`` epochs, in suffix tries of n-grams up to ``max_depth``
    tokens (at most ``max_nodes`` nodes each), per problem or global (``scope``)."""

    def __init__(self, window: int, scope: str = "problem", max_depth: int = 24, max_nodes: int = 1 << 20):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise DraftlabError(f"DAS window must be an integer number of epochs >= 1, got {window!r}")
        if scope not in SCOPES:
            raise DraftlabError(f"DAS scope must be one of {', '.join(SCOPES)}, got {scope!r}")
        SuffixProposer(max_depth=max_depth, max_nodes=max_nodes)  # the trie options' one check
        self.window, self.scope, self.max_depth, self.max_nodes = window, scope, max_depth, max_nodes
        self.router = PrefixRouter()
        self.problems: dict[int, _Problem] = {}
        self._global = SuffixTrie(max_depth, max_nodes) if scope == "global" else None
        self.epoch = 0

    def begin_epoch(self, epoch: int) -> None:
        """Epoch ``epoch`` starts: forget the rollouts of epochs <= epoch - window."""
        self.epoch = epoch
        for prob in self.problems.values():
            old = [s for s in prob.streams if s.epoch <= epoch - self.window]
            for s in old:
                prob.trie.remove(s.tokens)
            prob.streams = [s for s in prob.streams if s.epoch > epoch - self.window]
            prob.lengths = [(e, n) for e, n in prob.lengths if e > epoch - self.window]

    def problem(self, prompt_ids: list[int]) -> _Problem:
        key = self.router.route(prompt_ids)
        if key not in self.problems:
            trie = self._global if self._global is not None else SuffixTrie(self.max_depth, self.max_nodes)
            self.problems[key] = _Problem(trie)
        return self.problems[key]

    def trie(self, prompt_ids: list[int]) -> SuffixTrie:
        """The trie ``prompt_ids``'s rollouts draft from."""
        return self.problem(prompt_ids).trie

    def open(self, prompt_ids: list[int], response: list[int]) -> _Stream:
        """A rollout of ``prompt_ids`` starts with ``response``'s tokens: insert them after the
        prompt's last tokens (where the next rollout's match begins)."""
        prob = self.problem(prompt_ids)
        tail = list(prompt_ids[-(self.max_depth - 1) :])
        stream = _Stream(self.epoch, prob.trie, tail, len(tail))
        stream.live = prob.trie.insert([], tail)
        prob.streams.append(stream)
        self.extend(stream, response)
        return stream

    def extend(self, stream: _Stream, ids: list[int]) -> None:
        """Tokens verified since: into the trie at once (the problem's other samples see them)."""
        if ids:
            stream.live = stream.trie.insert(stream.live, ids)
            stream.tokens.extend(ids)

    def close(self, prompt_ids: list[int], response: list[int]) -> None:
        """A rollout of ``prompt_ids`` finished as ``response``: insert what its drafter never
        read (a finished row leaves the batch without advancing its proposer), record its length."""
        prob = self.problem(prompt_ids)
        for s in prob.streams:
            if not s.closed and s.epoch == self.epoch and response[: len(s.response)] == s.response:
                self.extend(s, response[len(s.response) :])
                s.closed = True
                break
        else:
            raise ValueError("RolloutHistory.close: no open rollout of this prompt is a prefix of the response")
        prob.lengths.append((self.epoch, len(response)))

    def recent_lengths(self, prompt_ids: list[int] | None = None) -> list[int]:
        """Response lengths of the rollouts of the window's past epochs (the current one left
        out, so that a length prediction holds for a whole epoch): of one prompt, or of all."""
        probs = [self.problem(prompt_ids)] if prompt_ids is not None else list(self.problems.values())
        return [n for p in probs for e, n in p.lengths if e < self.epoch]


class DASProposer(SuffixProposer):
    """The suffix drafter with its problem's windowed trie as the corpus; ``learn``: insert the
    verified tokens (False for decodings that are not rollouts, e.g. a greedy check); ``budget``:
    a :class:`~draftlab.inference.das_budget.LengthBudget` capping each draft, or None."""

    name = "das"
    shapes = frozenset({"chain"})

    def __init__(self, history: RolloutHistory, budget=None, learn: bool = True, min_prob: float = 0.1):
        super().__init__(max_depth=history.max_depth, max_nodes=history.max_nodes, min_prob=min_prob)
        self.history, self.budget, self.learn = history, budget, learn

    def frozen(self) -> "DASProposer":
        """The same drafter, reading the history without adding to it."""
        return DASProposer(self.history, self.budget, learn=False, min_prob=self.min_prob)

    def start(self, prompt_ids: torch.Tensor, hidden: dict, next_token: int) -> None:
        prompt = prompt_ids.reshape(-1).tolist()
        self.corpus = self.history.trie(prompt)  # this row's problem (forks share the history)
        self.stream = self.history.open(prompt, [int(next_token)]) if self.learn else None
        self.plan = self.budget.plan(self.history, prompt) if self.budget is not None else None
        self.generated = 1
        super().start(prompt_ids, hidden, next_token)

    def advance(self, accepted: torch.Tensor, hidden: dict) -> None:
        ids = accepted.reshape(-1).tolist()
        super().advance(accepted, hidden)
        self.generated += len(ids)
        if self.stream is not None:
            self.history.extend(self.stream, ids)

    def propose(self, shape: Chain) -> ChainDraft:
        k = shape.k if self.plan is None else min(shape.k, self.plan.k(self.generated))
        if k == 0:  # a short request: a plain step
            return ChainDraft(device_ints([], self._device))
        return super().propose(shape if k == shape.k else Chain(k))
