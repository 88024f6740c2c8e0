"""The oracle drafter: drafts the target's own greedy continuation, so greedy decoding accepts
every draft (τ = k + 1) and its speedup is the most the decoding engine gives at that k.

A drafter that is always right separates the engine's ceiling from a drafter's acceptance (the
"ideal acceptance" runs of SpecDecodeBench): a report whose oracle row is slow measures the
engine, not the drafter. The continuation of each prompt is decoded plainly once, by
:meth:`OracleProposer.prepare`, which the harness calls before timing (a prompt met unprepared is
decoded at its ``start``, which then counts as that decoding's prefill).
"""

from __future__ import annotations

import torch

from draftlab.device import device_ints
from draftlab.errors import DraftlabError
from draftlab.inference.proposer import FREE_DRAFTERS, DraftsOnDevice, PreparesPrompts, Proposer
from draftlab.inference.shapes import Chain, ChainDraft
from draftlab.inference.spec_loop import DeviceDrafter


@FREE_DRAFTERS.register("oracle")
class OracleProposer(Proposer, PreparesPrompts, DraftsOnDevice):
    """Options: ``max_new_tokens`` (the continuation decoded for a prompt met unprepared)."""

    name = "oracle"
    layers = ()
    shapes = frozenset({"chain"})
    OPTIONS = {"max_new_tokens": int}

    def __init__(self, target, max_new_tokens: int = 256):
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise DraftlabError(f"oracle drafter: max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        self.target, self.max_new_tokens = target, max_new_tokens
        self._continuations: dict[tuple[int, ...], list[int]] = {}  # shared by forks: prompt -> greedy tokens
        self._future: list[int] = []
        self._n = 0  # tokens emitted so far
        self._on_track = True  # every emitted token was the continuation's

    @classmethod
    def from_options(cls, options: dict[str, str]):
        unknown = sorted(set(options) - set(cls.OPTIONS))
        if unknown:
            raise DraftlabError(f"oracle drafter: unknown option {unknown[0]!r} (options: {', '.join(cls.OPTIONS)})")
        kw = {}
        for key, value in options.items():
            try:
                kw[key] = int(value)
            except ValueError:
                raise DraftlabError(f"oracle drafter: {key} must be an integer, got {value!r}") from None
        return lambda target: cls(target, **kw)

    def prepare(self, target, prompts, max_new_tokens: int, eos_token_id=None) -> None:
        """Decode each prompt's greedy continuation with ``target``: the engine that then verifies
        the drafts (the same rounding decides the same near-ties), before any timing."""
        from draftlab.inference.decoder import Decoder

        for p in map(_key, prompts):
            if len(self._continuations.get(p, ())) < max_new_tokens:
                res = Decoder(target).generate([list(p)], max_new_tokens, None, eos_token_id=eos_token_id)
                self._continuations[p] = res.rows[0].tokens

    def start(self, prompt_ids: torch.Tensor, hidden: dict, next_token: int) -> None:
        self._future = self.continuation(prompt_ids)
        self._n = 0
        self._on_track = True
        self._emit([int(next_token)])

    def advance(self, accepted: torch.Tensor, hidden: dict) -> None:
        self._emit(accepted.reshape(-1).tolist())

    def propose(self, shape: Chain) -> ChainDraft:
        draft = self._future[self._n : self._n + shape.k] if self._on_track else []
        return ChainDraft(device_ints(draft, self.target.device))

    def on_device(self, rows: int, room: int, shape) -> "OracleOnDevice":
        return OracleOnDevice(self, rows, room)

    def remember(self, prompt_ids, tokens: list[int]) -> None:
        """Take ``tokens`` as the prompt's greedy continuation (a plain decoding already made it)."""
        self._continuations[_key(prompt_ids)] = list(tokens)

    def continuation(self, prompt_ids) -> list[int]:
        key = _key(prompt_ids)
        if key not in self._continuations:
            self.prepare(self.target, [key], self.max_new_tokens)
        return self._continuations[key]

    def _emit(self, tokens: list[int]) -> None:
        # a row whose tokens left the continuation (a near-tie decided otherwise in a batch) drafts nothing
        self._on_track = self._on_track and tokens == self._future[self._n : self._n + len(tokens)]
        self._n += len(tokens)


class OracleOnDevice(DeviceDrafter):
    """Each row's continuation in a table; a row drafts the k tokens after those it emitted (a
    row that left the continuation drafts it anyway: verification rejects what does not follow)."""

    def __init__(self, oracle: OracleProposer, rows: int, room: int):
        dev = oracle.target.device
        self.oracle = oracle
        self.table = torch.zeros(rows, room, dtype=torch.long, device=dev)
        self.emitted = torch.zeros(rows, dtype=torch.long, device=dev)

    def start(self, row, prompt_ids, hidden, next_token) -> None:
        future = self.oracle.continuation(prompt_ids)[: self.table.shape[1]]
        self.table[row] = 0
        self.table[row, : len(future)] = device_ints(future, self.table.device)
        self.emitted[row] = 1

    def draft(self, b: int, k: int) -> torch.Tensor:
        at = self.emitted[:b, None] + torch.arange(k, device=self.table.device)
        return self.table[:b].gather(1, at.clamp(max=self.table.shape[1] - 1))

    def extend(self, b, tokens, hidden, counts) -> None:
        self.emitted[:b] += counts

    def select(self, index) -> None:
        for t in (self.table, self.emitted):
            t[: index.numel()] = t[index]


def _key(prompt) -> tuple[int, ...]:
    return tuple(int(t) for t in (prompt.reshape(-1).tolist() if isinstance(prompt, torch.Tensor) else prompt))
