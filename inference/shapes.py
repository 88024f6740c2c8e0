"""What one decoding step drafts: the draft shapes asked for, the drafts a proposer returns, and
the one check of a decoding's options against :mod:`draftlab.limits`.

Draft shapes, chosen per generation and handed to ``propose``:

- :class:`Chain` ``(k, min_confidence)``: up to k tokens, one after the other;
- :class:`Block` ``(k, min_confidence)``: k positions from one drafter forward, verified exactly like a chain;
- :class:`DynamicTree` ``(depth, top_k, total_tokens)``: the EAGLE-2 tree, grown by score;
- :class:`StaticTree` ``(choices)``: a fixed tree given as Medusa-style paths of candidate ranks.

A proposer returns a :class:`ChainDraft` for a chain or block and a :class:`DraftTree` for a tree,
either possibly carrying a :class:`Branch` (inputs the verify forward runs without verifying).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Callable, ClassVar, Mapping, Union

import torch

from draftlab.errors import DraftlabError
from draftlab.limits import MAX_BATCH_SIZE, MAX_K, MAX_NEW_TOKENS, MAX_TREE_NODES, SEED_RANGE, TEMPERATURE_RANGE


# ---------------------------------------------------------------------- what a proposer returns
@dataclass
class Branch:
    """Inputs that ride along a step's verify forward without being verified (Jacobi lookahead's
    branch): each sees the past, the step's last token and the branch inputs ``mask`` allows; no
    draft sees them, and their cache slots are dropped after the step. ``positions`` are offsets
    from the last token's position (>= 1); ``on_logits`` receives the target's logits after each
    input, [E, V], once the forward is done. At most
    :attr:`~draftlab.inference.proposer.Branching.branch_inputs` inputs."""

    tokens: torch.Tensor  # Long[E]
    positions: torch.Tensor  # Long[E]
    mask: torch.Tensor  # Bool[E, E]: input i may see input j
    on_logits: Callable[[torch.Tensor], None]


@dataclass
class ChainDraft:
    tokens: torch.Tensor  # Long[k], target-vocab ids (k may be smaller than asked, even 0)
    probs: torch.Tensor | None = None  # Float[k, V] draft distribution per position (None = point mass)
    branch: Branch | None = None


@dataclass
class DraftTree:
    # Node numbering: node 0 is the root (the last verified token); draft i is node i + 1.
    # Nodes are ordered so that a parent precedes its children, and siblings carry distinct tokens.
    tokens: torch.Tensor  # Long[N] draft tokens (root excluded), target-vocab ids
    parents: torch.Tensor  # Long[N] parent node index of draft i (0 = the root)
    depth: torch.Tensor  # Long[N] depth of each draft (1 = child of the root)
    branch: Branch | None = None


# ---------------------------------------------------------------------- bounds of the decoding options
# Every decoding option is checked against draftlab.limits before any work (:func:`check_decoding`,
# and each shape at construction), so that no value reaches an allocation or a loop unbounded.


class OptionError(DraftlabError):
    """A decoding option out of range. ``option`` names it as the Python API does (``k``,
    ``tree.depth``, ``tree.top_k``, ``tree.total_tokens``, ``static_tree``, ``min_confidence``,
    ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``batch_sizes``, ``seed``);
    ``detail`` says what is wrong, its limits included. :meth:`renamed` words it for a caller
    with its own names for the options (``--k``, ``eval.k``)."""

    def __init__(self, option: str, detail: str, message: str | None = None):
        super().__init__(message or f"{option} {detail}")
        self.option, self.detail = option, detail

    def renamed(self, names: Mapping[str, str]) -> "OptionError":
        return OptionError(self.option, self.detail, f"{names.get(self.option, self.option)} {self.detail}")


def _is_int(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _bounded_int(option: str, value, low: int, high: int, label: str | None = None) -> None:
    """``value`` an integer (not a bool) in ``low..high``, else an :class:`OptionError`."""
    if not _is_int(value) or not low <= value <= high:
        detail = f"must be an integer in {low}..{high}, got {value!r}"
        raise OptionError(option, detail, f"{label} {detail}" if label else None)


def _finite(option: str, value, label: str | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        detail = f"must be a finite number, got {value!r}"
        raise OptionError(option, detail, f"{label} {detail}" if label else None)
    return float(value)


# ---------------------------------------------------------------------- draft shapes
# ``kind`` is what proposers declare; ``method`` names the shape in recipes, flags and reports
# ("tree" is the dynamic tree's name there, kept from before static trees existed).
# ``max_nodes`` / ``max_depth`` bound what one step may draft (cache room, sanity checks).
# Each shape checks its fields at construction: integers (not bools) within the bounds above.


@dataclass(frozen=True)
class _Row:
    """Up to ``k`` tokens in a row, verified as a chain; ``min_confidence`` in [0, 1) (0 = off)
    shortens it where the drafter's confidence runs out (each shape says how)."""

    k: int
    min_confidence: float = 0.0

    def __post_init__(self):
        _bounded_int("k", self.k, 1, MAX_K, f"{self.method}: k")
        c = _finite("min_confidence", self.min_confidence, f"{self.method}: min_confidence")
        if not 0.0 <= c < 1.0:
            raise OptionError("min_confidence", f"must be in [0, 1), got {c}", f"{self.method}: min_confidence must be in [0, 1), got {c}")

    @property
    def max_nodes(self) -> int:
        return self.k

    max_depth = max_nodes


@dataclass(frozen=True)
class Chain(_Row):
    """Up to ``k`` tokens drafted one after another. ``min_confidence`` (EAGLE's dynamic draft
    length): stop before the draft at which the product of the drafter's top-1 probabilities
    drops below it (0 = always k); proposers without probabilities ignore it."""

    kind: ClassVar[str] = "chain"
    method: ClassVar[str] = "chain"


@dataclass(frozen=True)
class Block(_Row):
    """``k`` positions proposed by one drafter forward (parallel / block drafters); verified
    exactly like a chain. ``min_confidence`` (adaptive verification): a drafter that predicts
    each position's acceptance (DSpark's confidence head) cuts the block before the position at
    which the product of those predictions drops below it; block drafters without one ignore it."""

    kind: ClassVar[str] = "block"
    method: ClassVar[str] = "block"


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2 dynamic tree: ``depth`` expansion steps, ``top_k`` children per node, at most
    ``total_tokens`` draft nodes kept after reranking by cumulative log-prob. Each is in
    1..MAX_TREE_NODES. The total bounds the work: a kept node needs its ancestors kept, so no
    tree grows deeper than ``total_tokens`` levels (``max_depth``) whatever ``depth`` says."""

    depth: int = 5
    top_k: int = 8
    total_tokens: int = 48
    kind: ClassVar[str] = "dynamic_tree"
    method: ClassVar[str] = "tree"

    def __post_init__(self):
        for name in ("depth", "top_k", "total_tokens"):
            _bounded_int(f"tree.{name}", getattr(self, name), 1, MAX_TREE_NODES, f"tree: {name}")

    @property
    def max_nodes(self) -> int:
        return self.total_tokens

    @property
    def max_depth(self) -> int:
        return min(self.depth, self.total_tokens)


CHOICES_EXAMPLE = "[[0], [1], [0, 0]]"


def _static_tree_error(detail: str) -> OptionError:
    return OptionError("static_tree", detail, f"static tree: {detail}")


def _shown(value) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _choice_paths(choices) -> list[tuple[int, ...]]:
    """Distinct paths, sorted by depth then lexicographically (so parents come first): at most
    MAX_TREE_NODES of them, each a non-empty list of integer ranks in 0..MAX_TREE_NODES - 1."""
    bad = _static_tree_error(
        f"choices must be a non-empty list of at most {MAX_TREE_NODES} paths of candidate ranks, e.g. {CHOICES_EXAMPLE}"
    )
    if isinstance(choices, (str, bytes, Mapping)):
        raise bad
    try:
        choices = list(choices)
    except TypeError:
        raise bad from None
    if not choices or len(choices) > MAX_TREE_NODES:
        raise bad
    paths = set()
    for ch in choices:
        if isinstance(ch, (str, bytes, Mapping)):
            raise bad
        try:
            path = tuple(ch)
        except TypeError:
            raise bad from None
        if not path:
            raise bad
        for c in path:
            if not _is_int(c) or not 0 <= c < MAX_TREE_NODES:
                raise _static_tree_error(
                    f"choices must be paths of candidate ranks, integers in 0..{MAX_TREE_NODES - 1}: path {_shown(ch)} has rank {_shown(c)}"
                )
        paths.add(tuple(int(c) for c in path))
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
                raise _static_tree_error(f"choice {list(p)} has no parent {list(p[:-1])}")
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


def check_decoding(shape: Shape | None = None, max_new_tokens: int | None = None, temperature: float = 0.0,
                   top_k: int = 0, top_p: float = 1.0, batch_sizes=None, seed: int = 0, *,
                   draft_vocab: int | None = None, max_positions: int | None = None, prompt_length: int = 0) -> None:
    """The one check of a decoding's options, before any work: an :class:`OptionError` (a
    one-line DraftlabError naming the option, with its limits; :meth:`OptionError.renamed` words
    it with a caller's flag or field names) for the first out of range. Bounds:

    - ``shape``: a draft shape (its fields were checked at construction: k in 1..MAX_K; tree
      depth, top-k and total in 1..MAX_TREE_NODES; at most MAX_TREE_NODES static-tree paths of
      integer ranks in 0..MAX_TREE_NODES - 1); with ``draft_vocab`` (the tokens the drafter
      ranks its candidates over) a tree's top-k is at most that and a static tree's ranks are
      below it;
    - ``max_new_tokens`` (None: not checked): 1..MAX_NEW_TOKENS; with ``max_positions`` (the
      target's) at most ``max_positions - prompt_length`` (``prompt_length``: the longest prompt);
    - ``temperature``: 0 (greedy) or finite in TEMPERATURE_RANGE; ``top_k``: an integer >= 0
      (0 = off); ``top_p``: in (0, 1]; ``seed``: an integer in SEED_RANGE;
    - ``batch_sizes`` (None: not checked): distinct integers in 1..MAX_BATCH_SIZE.

    Call it once with what the flags or the recipe say (before any model loads) and again with
    ``draft_vocab`` / ``max_positions`` once the models are known (before any decoding)."""
    if shape is not None and not isinstance(shape, tuple(METHODS.values())):
        raise DraftlabError(f"shape must be one of {', '.join(c.__name__ for c in METHODS.values())}, got {shape!r}")
    if max_new_tokens is not None:
        _bounded_int("max_new_tokens", max_new_tokens, 1, MAX_NEW_TOKENS)
    t = _finite("temperature", temperature)
    lo, hi = TEMPERATURE_RANGE
    if t != 0.0 and not lo <= t <= hi:
        raise OptionError("temperature", f"must be 0 (greedy) or in [{lo:g}, {hi:g}], got {t:g}")
    if not _is_int(top_k) or top_k < 0:
        raise OptionError("top_k", f"must be an integer >= 0 (0 = off), got {top_k!r}")
    p = _finite("top_p", top_p)
    if not 0.0 < p <= 1.0:
        raise OptionError("top_p", f"must be in (0, 1], got {p:g}")
    _bounded_int("seed", seed, *SEED_RANGE)
    if batch_sizes is not None:
        sizes = list(batch_sizes) if isinstance(batch_sizes, (list, tuple)) else None
        if not sizes or any(not _is_int(b) or not 1 <= b <= MAX_BATCH_SIZE for b in sizes) or len(set(sizes)) != len(sizes):
            raise OptionError("batch_sizes", f"must be distinct integers in 1..{MAX_BATCH_SIZE}, e.g. 1,2,4,8, got {batch_sizes!r}")
    if draft_vocab is not None:
        if isinstance(shape, DynamicTree) and shape.top_k > draft_vocab:
            raise OptionError("tree.top_k", f"must be at most the draft vocabulary ({draft_vocab} tokens), got {shape.top_k}")
        if isinstance(shape, StaticTree) and shape.max_rank > draft_vocab:
            raise _static_tree_error(
                f"rank {shape.max_rank - 1} is beyond the draft vocabulary: ranks must be below {draft_vocab}"
            )
    if max_positions is not None and max_new_tokens is not None:
        room = max_positions - prompt_length
        if room < 1:
            raise DraftlabError(f"a prompt of {prompt_length} tokens leaves no room for new tokens: the target holds {max_positions} positions")
        if max_new_tokens > room:
            raise OptionError(
                "max_new_tokens",
                f"must be at most {room} (the target's {max_positions} positions less the longest prompt's {prompt_length}), got {max_new_tokens}",
            )


def check_shape(shape, shapes: frozenset[str], drafter: str) -> None:
    """Refuse a shape whose kind is not among ``shapes`` (a proposer's), naming ``drafter``."""
    if not isinstance(shape, tuple(METHODS.values())):
        raise DraftlabError(f"shape must be one of {', '.join(c.__name__ for c in METHODS.values())}, got {shape!r}")
    if shape.kind not in shapes:
        raise DraftlabError(f"drafter '{drafter}' does not draft {shape.kind} shapes (it drafts: {', '.join(sorted(shapes)) or 'none'})")

