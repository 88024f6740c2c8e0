"""The one interface between the speculative decoder and whatever drafts tokens.

The decoder and the verify kernels never know which drafter is behind a proposer: every drafter
family's proposer and the training-free drafters implement this. What a step drafts (the shapes
and the drafts) is :mod:`~draftlab.inference.shapes`; the sampling parameters are
:mod:`~draftlab.inference.sampling`'s.

Each proposer declares the ``kind`` of the shapes it drafts in ``shapes``; the decoder refuses
any other. A drafter family registers its proposer class in :data:`PROPOSERS` under its
``algorithm`` names, in its own module; it is built as ``cls(drafter, trained_depth=n)`` from a
loaded drafter (:func:`load_proposer`), every decoding option travelling in the shape instead.

Protocol. The decoder drafts for a batch of B sequences through ``proposer.batched(B, shape)``,
a :class:`RowProposers` (a batch of one wraps the proposer itself), whose rows are addressed by
position among the sequences still decoding:

0. ``configure(sampling)`` before each generation: the decoding parameters (temperature,
   top-k, top-p and the seeded generator). A proposer that returns draft probabilities uses
   ``sampling.probs(logits)`` for them and ``sampling.sample(probs)`` to draw its tokens.
1. ``start(row, prompt_ids, hidden, next_token)`` per row after the target's prefill:
   ``prompt_ids`` Long[T], ``hidden`` the target's hidden states of every prompt position
   (indices in ``Proposer.layers``, [1, T, H] each), ``next_token`` the target's token after it.
2. ``propose(shape)``: one draft per row, following everything seen so far: a
   :class:`ChainDraft` of at most ``shape.k`` tokens for a chain or block (it may return fewer,
   even none), a :class:`DraftTree` rooted at the last token for a tree.
3. ``advance(accepted, hidden, rows)``, only before those rows draft again: per row the tokens
   kept since it last drafted (accepted drafts then the bonus/correction token, of one or more
   steps) and the target's hidden states of the kept *inputs* (the previous last token and the
   accepted drafts; for a tree, the root and the accepted path's nodes), [1, n, H] each.
4. ``select(rows)`` when sequences finish: keep only the proposers of ``rows``.

The default ``batched`` forks the proposer per row (:meth:`Proposer.fork`) and relays these
calls to each fork's one-sequence ``start`` / ``propose`` / ``advance``, row after row; a family
may return its own :class:`RowProposers` subclass that drafts every row at once
(:class:`BatchProposer` relays a batch of one to such rows too). Per-row state lives in the
:class:`RowProposers` (or the forks it holds), nowhere else.

Optional capabilities. What only some families need is a small class the family also derives
from, which the decoder and the harness test with ``isinstance``; the base class has none of it:

- :class:`ChangesVerifier`: the drafts are verified by a target the family changes (Medusa-2
  merges its adapters into it): ``verifier(target)`` and ``verifier_report(...)``;
- :class:`OwnModel`: the family drafts with a model of its own over its own KV cache (a draft
  LM): ``cache_bytes_per_token`` and ``use_graphs(wrap)``;
- :class:`DraftsWithTarget`: the family drafts with the target itself (layer skipping, sparse
  attention): ``use_target(steps)`` before ``start``, relayed by :meth:`RowProposers.use_target`;
- :class:`Branching`: its drafts carry a ``Branch`` of at most ``branch_inputs`` inputs
  (Jacobi lookahead), for which the decoder reserves room in the target's cache;
- :class:`DraftsOnDevice`: its chains are drafted by tensor ops over static buffers
  (``on_device``), so a whole speculative step runs on the device as one graph
  (:mod:`~draftlab.inference.spec_loop`).

A draft may carry a :class:`~draftlab.inference.shapes.Branch`: inputs the verify forward also runs, whose logits go back
to the proposer (Jacobi lookahead drafts its next guesses so, in the forward that verifies these).

Losslessness contract for sampling (temperature > 0): ``ChainDraft.probs[j]`` must be the
distribution ``tokens[j]`` was actually drawn from, processed by ``sampling.probs`` so the draft
q sees the same temperature / top-k / top-p as the target's p. A proposer that picks tokens
deterministically (argmax, top-k tree expansion, prompt lookup) returns ``probs=None``: the
verifier then treats each draft as a point mass, which is lossless for any choice of tokens.
Tree siblings must carry distinct tokens.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from draftlab.inference.sampling import Sampling
from draftlab.inference.shapes import ChainDraft, DraftTree, Shape, check_decoding, check_shape
from draftlab.registry import Registry


class Proposer:
    """Base class: a drafter seen from the decoder. ``draft_vocab``: the tokens it ranks tree
    candidates over (None: the target's vocabulary); ``trained_depth``: the chained draft
    positions its drafter was trained to draft (None: no bound known; the checkpoint's recipe
    says, :meth:`Drafter.trained_depth`). A family built from a drafter passes both to
    ``__init__``; the class defaults serve proposers that know neither."""

    name: str = "proposer"
    layers: tuple[int, ...] = ()  # target hidden-state indices needed in start/advance
    shapes: ClassVar[frozenset[str]] = frozenset()  # the ``kind`` of every shape ``propose`` drafts
    sampling: Sampling = Sampling()
    draft_vocab: int | None = None
    trained_depth: int | None = None

    def __init__(self, *, draft_vocab: int | None = None, trained_depth: int | None = None):
        self.draft_vocab, self.trained_depth = draft_vocab, trained_depth

    @classmethod
    def check(cls, shape: Shape, drafter) -> None:
        """Refuse (one-line DraftlabError) a shape of a supported kind that ``drafter`` cannot
        fill: a block longer than it drafts, a tree deeper than its heads. Training calls it
        before the first step, so a recipe's eval shape fails at start, not at the first
        checkpoint. Default: every shape of a supported kind fits."""

    def configure(self, sampling: Sampling) -> None:
        self.sampling = sampling

    def start(self, prompt_ids: torch.Tensor, hidden: dict[int, torch.Tensor], next_token: int) -> None:
        raise NotImplementedError

    def propose(self, shape: Shape) -> ChainDraft | DraftTree:
        """A :class:`ChainDraft` for a chain or block, a :class:`DraftTree` for a tree; only
        called with shapes whose kind is in ``shapes``."""
        raise NotImplementedError

    def advance(self, accepted: torch.Tensor, hidden: dict[int, torch.Tensor]) -> None:
        raise NotImplementedError

    def fork(self) -> "Proposer":
        """A proposer for another sequence: the same drafter (weights shared, not copied) with
        its own per-sequence state. The default shallow copy is right for proposers whose
        ``start`` sets all of that state anew; one holding other proposers forks them too."""
        return copy.copy(self)

    def batched(self, n: int, shape: Shape) -> "RowProposers":
        """The proposer of ``n`` sequences decoded together with drafts of ``shape``'s kind
        (:mod:`draftlab.inference.decoder`). Default: one fork per row, drafting row after row; a
        family may return its own :class:`RowProposers` subclass that drafts every row at once."""
        return RowProposers([self.fork() for _ in range(n)])


# ---------------------------------------------------------------------- optional capabilities
class ChangesVerifier(ABC):
    """A proposer whose drafts are verified by a target it changes (Medusa-2 merges its LoRA
    adapters into it). Decoding is lossless with respect to :meth:`verifier`'s target, and the
    plain baseline a speedup is measured against decodes with it too (:func:`verifying_target`)."""

    @abstractmethod
    def verifier(self, target):
        """The target whose forwards verify the drafts, given the one it was loaded next to."""

    @abstractmethod
    def verifier_report(self, target, prompts, max_new_tokens: int, eos_token_id=None) -> dict:
        """What an acceptance report must say about :meth:`verifier` besides acceptance,
        measured on ``prompts``."""


def verifying_target(proposer: Proposer, target):
    """The target that verifies ``proposer``'s drafts: ``target`` itself, unless the proposer
    changes it (:class:`ChangesVerifier`)."""
    return proposer.verifier(target) if isinstance(proposer, ChangesVerifier) else target


class OwnModel(ABC):
    """A proposer that drafts with a model of its own, over a KV cache of its own (a draft LM).
    ``cache_bytes_per_token``: that cache's bytes per token of context (a report states it as a
    share of the target's)."""

    cache_bytes_per_token: int

    @abstractmethod
    def use_graphs(self, wrap) -> None:
        """Run the own model through ``wrap(model)`` from now on (``wrap``: a model whose
        decoding forwards replay CUDA graphs, :func:`~draftlab.inference.graphs.graphed`)."""


class DraftsWithTarget:
    """A proposer that drafts with the target itself (layer skipping): before ``start`` it is
    handed ``steps`` (:class:`~draftlab.inference.decoder.TargetSteps`), which runs the target
    over the decoder's KV cache; the decoder passes it through :meth:`RowProposers.use_target`."""

    steps = None  # the TargetSteps of the generation under way

    def use_target(self, steps) -> None:
        self.steps = steps


class PreparesPrompts(ABC):
    """A proposer that reads every prompt before decoding starts (the oracle decodes each one's
    continuation): the harness calls :meth:`prepare` before it times anything."""

    @abstractmethod
    def prepare(self, target, prompts, max_new_tokens: int, eos_token_id=None) -> None:
        """Read ``prompts`` (token lists) with ``target``, the verifier that will decode them."""


class Branching:
    """A proposer whose drafts carry a :class:`~draftlab.inference.shapes.Branch` (Jacobi lookahead): ``branch_inputs`` is the
    most inputs one holds, the room the decoder reserves for them in the target's cache."""

    branch_inputs: int



class DraftsOnDevice(ABC):
    """A proposer whose chain drafts are tensor ops over static buffers: the device loop
    (:mod:`~draftlab.inference.spec_loop`) drafts, verifies, accepts and extends it in one graph."""

    def refuses_on_device(self, shape) -> str | None:
        """Why drafting ``shape`` cannot run on the device (then the host loop runs it), or None;
        by default chains and blocks run there, trees do not."""
        if shape.kind in ("chain", "block"):
            return None
        return f"proposer '{self.name}' drafts {shape.kind.replace('_', ' ')}s on the host"

    @abstractmethod
    def on_device(self, rows: int, room: int, shape):
        """A :class:`~draftlab.inference.spec_loop.DeviceDrafter` for ``rows`` rows of up to
        ``room`` positions each, drafting ``shape``."""

# ---------------------------------------------------------------------- the rows of a batch
class RowProposers:
    """Proposers of the rows of a batch, addressed by their position among the rows still
    decoding; the protocol of :class:`Proposer`, one call for all rows."""

    def __init__(self, rows: list[Proposer]):
        self.rows = rows

    def configure(self, sampling: Sampling) -> None:
        for p in self.rows:
            p.configure(sampling)

    def use_target(self, steps) -> None:
        """The decoder's :class:`~draftlab.inference.decoder.TargetSteps` for the generation, for
        the rows that draft with the target (:class:`DraftsWithTarget`); rows drafting every row
        at once with the target take it themselves (override)."""
        for p in self.rows:
            if isinstance(p, DraftsWithTarget):
                p.use_target(steps)

    def start(self, row: int, prompt_ids: torch.Tensor, hidden: dict[int, torch.Tensor], next_token: int) -> None:
        self.rows[row].start(prompt_ids, hidden, next_token)

    def propose(self, shape: Shape) -> list:
        return [p.propose(shape) for p in self.rows]

    def advance(self, accepted: list[torch.Tensor], hidden: list[dict[int, torch.Tensor]], rows: list[int]) -> None:
        """Advance the proposers at ``rows`` (positions among the rows still decoding)."""
        for r, a, h in zip(rows, accepted, hidden):
            self.rows[r].advance(a, h)

    def select(self, rows: list[int]) -> None:
        """Keep only the proposers at ``rows`` (finished sequences leave the batch)."""
        self.rows = [self.rows[r] for r in rows]


class BatchProposer(Proposer):
    """A proposer whose drafter works on every row of a batch at once (one forward per draft
    position): :meth:`rows` builds its :class:`RowProposers` of ``n`` rows, which ``batched``
    returns; a batch of one, which the decoder drafts through the proposer itself, relays to a
    one-row one (kept as ``rows_of_one`` after the generation)."""

    rows_of_one: RowProposers | None = None

    def rows(self, n: int) -> RowProposers:
        raise NotImplementedError

    def batched(self, n: int, shape: Shape) -> RowProposers:
        return self.rows(n)

    def start(self, prompt_ids, hidden, next_token) -> None:
        self.rows_of_one = one = self.rows(1)
        one.configure(self.sampling)
        if isinstance(self, DraftsWithTarget):
            one.use_target(self.steps)
        one.start(0, prompt_ids, hidden, next_token)

    def propose(self, shape: Shape):
        return self.rows_of_one.propose(shape)[0]

    def advance(self, accepted, hidden) -> None:
        self.rows_of_one.advance([accepted], [hidden], [0])


# ---------------------------------------------------------------------- registries, loading
# Proposer classes by drafter ``algorithm`` (built as ``cls(drafter, trained_depth=n)``),
# registered where they are defined; the training-free "ngram" is registered too but built with
# its own options.
PROPOSERS: Registry[type[Proposer]] = Registry("proposer")

# Training-free drafters other than "ngram" (which keeps its own flags), built by name
# (``--drafter NAME``) rather than from a checkpoint, registered where they are defined. Each
# class has ``from_options(options)``: it checks ``options`` (the ``--drafter-option`` KEY=VALUE
# pairs, values as strings; a one-line DraftlabError naming the bad one) before any model loads
# and returns the function that builds the proposer next to the loaded target.
FREE_DRAFTERS: Registry[type[Proposer]] = Registry("training-free drafter")


def draft_vocab_size(drafter) -> int | None:
    """The tokens a drafter ranks its candidates over: its draft vocabulary (``d2t``), else
    ``draft_vocab_size``, else the target's vocabulary (``vocab_size``); None if it says none."""
    d2t = getattr(drafter, "d2t", None)
    if isinstance(d2t, torch.Tensor) and d2t.dim() == 1:
        return int(d2t.numel())
    size = getattr(drafter, "draft_vocab_size", None) or getattr(drafter, "vocab_size", None)
    return int(size) if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def load_proposer(checkpoint_dir, target, shape: Shape | None = None) -> Proposer:
    """The proposer of a drafter checkpoint, next to ``target``. With ``shape``, refuse (an
    :class:`OptionError` where an option is out of the drafter's range) a shape it cannot draft:
    a kind it does not draft, a tree wider than its vocabulary, what :meth:`Proposer.check` refuses."""
    from draftlab.checkpoint import load_drafter

    drafter, meta = load_drafter(checkpoint_dir, target)
    recipe = meta.get("recipe")
    loss = recipe.get("loss") if isinstance(recipe, dict) else None
    trained_depth = drafter.trained_depth(loss if isinstance(loss, dict) else {})
    proposer = PROPOSERS.get(drafter.algorithm, f"{checkpoint_dir}: algorithm")(drafter, trained_depth=trained_depth)
    if shape is not None:
        check_shape(shape, proposer.shapes, proposer.name)
        check_decoding(shape, draft_vocab=proposer.draft_vocab)
        proposer.check(shape, drafter)
    return proposer
