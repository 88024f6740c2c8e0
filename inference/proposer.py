"""The one interface between the speculative decoder and whatever drafts tokens.

The decoder and the verify kernels never know which drafter is behind a proposer: every drafter
family's proposer and the training-free n-gram prompt lookup implement this.

Draft shapes: what one step drafts, chosen per generation and handed to ``propose``:

- :class:`Chain` ``(k, min_confidence)``: up to k tokens, one after the other;
- :class:`Block` ``(k)``: k positions from one drafter forward, verified exactly like a chain;
- :class:`DynamicTree` ``(depth, top_k, total_tokens)``: the EAGLE-2 tree, grown by score;
- :class:`StaticTree` ``(choices)``: a fixed tree given as Medusa-style paths of candidate ranks.

Each proposer declares the ``kind`` of the shapes it drafts in ``shapes``; the decoder refuses
any other. A drafter family registers its proposer class in :data:`PROPOSERS` under its
``algorithm`` names, in its own module; it is built as ``cls(drafter)`` from a loaded drafter
(:func:`load_proposer`), every decoding option travelling in the shape instead.

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
may return its own :class:`RowProposers` subclass that drafts every row at once.

Losslessness contract for sampling (temperature > 0): ``ChainDraft.probs[j]`` must be the
distribution ``tokens[j]`` was actually drawn from, processed by ``sampling.probs`` so the draft
q sees the same temperature / top-k / top-p as the target's p. A proposer that picks tokens
deterministically (argmax, top-k tree expansion, prompt lookup) returns ``probs=None``: the
verifier then treats each draft as a point mass, which is lossless for any choice of tokens.
Tree siblings must carry distinct tokens.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import ClassVar, Union

import torch

from draftlab.errors import DraftlabError
from draftlab.registry import Registry


def process_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The decoding distribution, the single definition shared by plain decoding, the verifier's
    target p and any draft q: softmax(logits / T), then keep the ``top_k`` most likely tokens,
    then the smallest most-likely set whose mass reaches ``top_p`` (the top token always stays),
    renormalised. Float32 probabilities over the last dim. ``temperature`` must be > 0."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    V = probs.shape[-1]
    if 0 < top_k < V:
        kth = probs.topk(top_k, dim=-1).values[..., -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # A token is dropped once the mass strictly before it already reaches top_p.
        before = sorted_p.cumsum(-1) - sorted_p
        drop_sorted = before >= top_p * sorted_p.sum(-1, keepdim=True)
        drop_sorted[..., 0] = False
        probs = probs.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), 0.0)
    return probs / probs.sum(-1, keepdim=True)


@dataclass
class Sampling:
    """Decoding parameters of one generation. ``temperature == 0`` means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Processed distribution over the last dim (one-hot on the argmax when greedy)."""
        if self.greedy:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        return process_logits(logits, self.temperature, self.top_k, self.top_p)

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per row of ``probs`` [..., V] (argmax when greedy), drawn with the generator."""
        if self.greedy:
            return probs.argmax(-1)
        flat = probs.reshape(-1, probs.shape[-1])
        return torch.multinomial(flat, 1, generator=self.generator).view(probs.shape[:-1])


# ---------------------------------------------------------------------- what a proposer returns
@dataclass
class ChainDraft:
    tokens: torch.Tensor  # Long[k], target-vocab ids (k may be smaller than asked, even 0)
    probs: torch.Tensor | None = None  # Float[k, V] draft distribution per position (None = point mass)


@dataclass
class DraftTree:
    # Node numbering: node 0 is the root (the last verified token); draft i is node i + 1.
    # Nodes are ordered so that a parent precedes its children, and siblings carry distinct tokens.
    tokens: torch.Tensor  # Long[N] draft tokens (root excluded), target-vocab ids
    parents: torch.Tensor  # Long[N] parent node index of draft i (0 = the root)
    depth: torch.Tensor  # Long[N] depth of each draft (1 = child of the root)


# ---------------------------------------------------------------------- draft shapes
# ``kind`` is what proposers declare; ``method`` names the shape in recipes, flags and reports
# ("tree" is the dynamic tree's name there, kept from before static trees existed).
# ``max_nodes`` / ``max_depth`` bound what one step may draft (cache room, sanity checks).


def _at_least_one(shape: str, **values: int) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or v < 1:
            raise DraftlabError(f"{shape}: {name} must be an integer >= 1, got {v!r}")


@dataclass(frozen=True)
class _Row:
    """Up to ``k`` tokens in a row, verified as a chain."""

    k: int

    def __post_init__(self):
        _at_least_one(self.method, k=self.k)

    @property
    def max_nodes(self) -> int:
        return self.k

    max_depth = max_nodes


@dataclass(frozen=True)
class Chain(_Row):
    """Up to ``k`` tokens drafted one after another. ``min_confidence`` (EAGLE's dynamic draft
    length): stop before the draft at which the product of the drafter's top-1 probabilities
    drops below it (0 = always k); proposers without probabilities ignore it."""

    min_confidence: float = 0.0
    kind: ClassVar[str] = "chain"
    method: ClassVar[str] = "chain"

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.min_confidence < 1.0:
            raise DraftlabError(f"chain: min_confidence must be in [0, 1), got {self.min_confidence}")


@dataclass(frozen=True)
class Block(_Row):
    """``k`` positions proposed by one drafter forward (parallel / block drafters); verified
    exactly like a chain."""

    kind: ClassVar[str] = "block"
    method: ClassVar[str] = "block"


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2 dynamic tree: ``depth`` expansion steps, ``top_k`` children per node, at most
    ``total_tokens`` draft nodes kept after reranking by cumulative log-prob."""

    depth: int = 5
    top_k: int = 8
    total_tokens: int = 48
    kind: ClassVar[str] = "dynamic_tree"
    method: ClassVar[str] = "tree"

    def __post_init__(self):
        _at_least_one("tree", depth=self.depth, top_k=self.top_k, total_tokens=self.total_tokens)

    @property
    def max_nodes(self) -> int:
        return self.total_tokens

    @property
    def max_depth(self) -> int:
        return self.depth


CHOICES_EXAMPLE = "[[0], [1], [0, 0]]"


def _choice_paths(choices) -> list[tuple[int, ...]]:
    """Distinct paths, sorted by depth then lexicographically (so parents come first)."""
    bad = DraftlabError(f"static tree: choices must be a non-empty list of paths of candidate ranks >= 0, e.g. {CHOICES_EXAMPLE}")
    try:
        paths = {tuple(ch) for ch in choices}
    except TypeError:
        raise bad from None
    if not paths or any(not p or not all(isinstance(c, int) and c >= 0 for c in p) for p in paths):
        raise bad
    return sorted(paths, key=lambda p: (len(p), p))


@dataclass(frozen=True, eq=False)
class StaticTree:
    """A fixed tree given as Medusa-style choices: each path lists per-level candidate ranks
    from the root, e.g. ``[(0,), (1,), (0, 0), (0, 1)]`` = the drafter's top-2 tokens after the
    root, and the top-2 after the best of them. Node order: by depth, then lexicographic
    (parents first); node i + 1 is ``choices[i]`` after that sorting."""

    choices: tuple[tuple[int, ...], ...]
    parents: torch.Tensor = field(init=False, repr=False)  # Long[N], 0 = root
    depth: torch.Tensor = field(init=False, repr=False)  # Long[N]
    rank: torch.Tensor = field(init=False, repr=False)  # Long[N]: candidate rank among its parent's candidates
    kind: ClassVar[str] = "static_tree"
    method: ClassVar[str] = "static_tree"

    def __post_init__(self):
        paths = _choice_paths(self.choices)
        index = {p: i + 1 for i, p in enumerate(paths)}
        for p in paths:
            if len(p) > 1 and p[:-1] not in index:
                raise DraftlabError(f"static tree: choice {list(p)} has no parent {list(p[:-1])}")
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
        # frozen: the derived fields are set once, here
        object.__setattr__(self, "choices", tuple(paths))
        object.__setattr__(self, "parents", as_long([index[p[:-1]] if len(p) > 1 else 0 for p in paths]))
        object.__setattr__(self, "depth", as_long([len(p) for p in paths]))
        object.__setattr__(self, "rank", as_long([p[-1] for p in paths]))

    @property
    def max_nodes(self) -> int:
        return len(self.choices)

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    @property
    def max_rank(self) -> int:
        return int(self.rank.max()) + 1

    def draft(self, candidates: torch.Tensor) -> DraftTree:
        """Fill the shape from per-level candidates ``Long[D, K]`` (row d = the ranked tokens for
        depth d + 1, e.g. Medusa head d's top-K): node tokens are ``candidates[depth-1, rank]``.
        Distinct candidates per row keep siblings distinct."""
        if candidates.shape[0] < self.max_depth or candidates.shape[1] < self.max_rank:
            raise ValueError(
                f"static tree needs candidates of at least [{self.max_depth}, {self.max_rank}], got {list(candidates.shape)}"
            )
        dev = candidates.device
        tokens = candidates[self.depth.to(dev) - 1, self.rank.to(dev)]
        return DraftTree(tokens, self.parents.to(dev), self.depth.to(dev))


Shape = Union[Chain, Block, DynamicTree, StaticTree]
METHODS: dict[str, type] = {cls.method: cls for cls in (Chain, DynamicTree, StaticTree, Block)}


def make_shape(method: str, k: int = 5, min_confidence: float = 0.0, tree: dict | None = None, choices=None) -> Shape:
    """The shape a recipe's eval section or ``draftlab eval``'s flags ask for, by method name:
    ``k`` (and ``min_confidence``) for chain and block, ``tree`` (:class:`DynamicTree`'s fields)
    for "tree", ``choices`` for "static_tree"."""
    if method not in METHODS:
        raise DraftlabError(f"method must be one of {', '.join(METHODS)}, got '{method}'")
    if min_confidence and method != "chain":
        raise DraftlabError(f"min_confidence applies to method chain, not '{method}'")
    if method == "static_tree" and choices is None:
        raise DraftlabError(f"method static_tree needs choices (paths of candidate ranks, e.g. {CHOICES_EXAMPLE})")
    if method == "chain":
        return Chain(k, min_confidence)
    if method == "block":
        return Block(k)
    if method == "tree":
        return DynamicTree(**(tree or {}))
    return StaticTree(choices)


def shape_fields(shape: Shape) -> dict:
    """The shape in a report: ``method``, ``k`` (chain and block) and ``tree`` (dynamic tree),
    None where they do not apply, plus ``static_tree`` choices and ``min_confidence`` when used."""
    fields = {
        "method": shape.method,
        "k": getattr(shape, "k", None),
        "tree": {"depth": shape.depth, "top_k": shape.top_k, "total_tokens": shape.total_tokens}
        if isinstance(shape, DynamicTree) else None,
    }
    if isinstance(shape, StaticTree):
        fields["static_tree"] = [list(p) for p in shape.choices]
    if getattr(shape, "min_confidence", 0.0):
        fields["min_confidence"] = shape.min_confidence
    return fields


# ---------------------------------------------------------------------- proposers
class Proposer:
    """Base class: a drafter seen from the decoder."""

    name: str = "proposer"
    layers: tuple[int, ...] = ()  # target hidden-state indices needed in start/advance
    shapes: ClassVar[frozenset[str]] = frozenset()  # the ``kind`` of every shape ``propose`` drafts
    sampling: Sampling = Sampling()
    # chained draft positions the drafter was trained to draft (None: no bound known); set by
    # load_proposer from the checkpoint's recipe (Drafter.trained_depth)
    trained_depth: int | None = None

    def verifier(self, target):
        """The target whose forwards verify this proposer's drafts, given the one it was loaded
        next to: that target itself, unless the family also changes the target (Medusa-2
        merges its LoRA adapters into it). Decoding is lossless with respect to the returned
        target, and the plain baseline a speedup is measured against decodes with it too."""
        return target

    def verifier_report(self, target, prompts, max_new_tokens: int, eos_token_id=None) -> dict | None:
        """What an acceptance report must say about :meth:`verifier` besides acceptance, measured
        on ``prompts``; None when the verifier is ``target`` itself (the default)."""
        return None

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


class RowProposers:
    """Proposers of the rows of a batch, addressed by their position among the rows still
    decoding; the protocol of :class:`Proposer`, one call for all rows."""

    def __init__(self, rows: list[Proposer]):
        self.rows = rows

    def configure(self, sampling: Sampling) -> None:
        for p in self.rows:
            p.configure(sampling)

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


def check_shape(shape, shapes: frozenset[str], drafter: str) -> None:
    """Refuse a shape whose kind is not among ``shapes`` (a proposer's), naming ``drafter``."""
    if not isinstance(shape, tuple(METHODS.values())):
        raise DraftlabError(f"shape must be one of {', '.join(c.__name__ for c in METHODS.values())}, got {shape!r}")
    if shape.kind not in shapes:
        raise DraftlabError(f"drafter '{drafter}' does not draft {shape.kind} shapes (it drafts: {', '.join(sorted(shapes)) or 'none'})")


# Proposer classes by drafter ``algorithm`` (built as ``cls(drafter)``), registered where they
# are defined; the training-free "ngram" is registered too but built with its own options.
PROPOSERS: Registry[type[Proposer]] = Registry("proposer")


def load_proposer(checkpoint_dir, target) -> Proposer:
    """The proposer of a drafter checkpoint, next to ``target``."""
    from draftlab.checkpoint import load_drafter

    drafter, meta = load_drafter(checkpoint_dir, target)
    proposer = PROPOSERS.get(drafter.algorithm, f"{checkpoint_dir}: algorithm")(drafter)
    recipe = meta.get("recipe")
    loss = recipe.get("loss") if isinstance(recipe, dict) else None
    proposer.trained_depth = drafter.trained_depth(loss if isinstance(loss, dict) else {})
    return proposer
