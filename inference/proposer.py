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
   ``use_target(steps)`` too: what a proposer that drafts with the target itself (layer
   skipping) runs it with; the others ignore it.
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
(:class:`BatchProposer` relays a batch of one to such rows too).

A draft may carry a :class:`Branch`: inputs the verify forward also runs, whose logits go back
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
import json
import math
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Callable, ClassVar, Mapping, Union

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
class Branch:
    """Inputs that ride along a step's verify forward without being verified (Jacobi lookahead's
    branch): each sees the past, the step's last token and the branch inputs ``mask`` allows; no
    draft sees them, and their cache slots are dropped after the step. ``positions`` are offsets
    from the last token's position (>= 1); ``on_logits`` receives the target's logits after each
    input, [E, V], once the forward is done. At most :attr:`Proposer.branch_inputs` inputs."""

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
# Every decoding option is checked against these before any work (:func:`check_decoding`, and each
# shape at construction), so that no value reaches an allocation or a loop unbounded.
from draftlab.limits import MAX_BATCH_SIZE, MAX_K, MAX_NEW_TOKENS, MAX_TREE_NODES, SEED_RANGE, TEMPERATURE_RANGE  # noqa: E402,F401


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
    """Up to ``k`` tokens in a row, verified as a chain."""

    k: int

    def __post_init__(self):
        _bounded_int("k", self.k, 1, MAX_K, f"{self.method}: k")

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
        c = _finite("min_confidence", self.min_confidence, "chain: min_confidence")
        if not 0.0 <= c < 1.0:
            raise OptionError("min_confidence", f"must be in [0, 1), got {c}", f"chain: min_confidence must be in [0, 1), got {c}")


@dataclass(frozen=True)
class Block(_Row):
    """``k`` positions proposed by one drafter forward (parallel / block drafters); verified
    exactly like a chain."""

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


def draft_vocab_size(drafter) -> int | None:
    """The tokens a drafter ranks its candidates over: its draft vocabulary (``d2t``), else
    ``draft_vocab_size``, else the target's vocabulary (``vocab_size``); None if it says none."""
    d2t = getattr(drafter, "d2t", None)
    if isinstance(d2t, torch.Tensor) and d2t.dim() == 1:
        return int(d2t.numel())
    size = getattr(drafter, "draft_vocab_size", None) or getattr(drafter, "vocab_size", None)
    return int(size) if _is_int(size) and size > 0 else None


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
    # the tokens it ranks tree candidates over (None: the target's vocabulary); set by load_proposer
    draft_vocab: int | None = None
    # bytes per token of context of the drafter's own KV cache (None: it keeps none or does not
    # say); a report states it as a share of the target's
    cache_bytes_per_token: int | None = None
    # most inputs a draft's Branch holds (the decoder reserves that room in the target's cache)
    branch_inputs: int = 0

    def verifier(self, target):
        """The target whose forwards verify this proposer's drafts, given the one it was loaded
        next to: that target itself, unless the family also changes the target (Medusa-2
        merges its LoRA adapters into it). Decoding is lossless with respect to the returned
        target, and the plain baseline a speedup is measured against decodes with it too."""
        return target

    def use_graphs(self, wrap) -> None:
        """Run the drafter's own model through ``wrap(model)`` from now on, where it has a model
        with the target's forward over a ragged KV cache (``wrap``: a model whose decoding
        forwards replay CUDA graphs, :mod:`~draftlab.inference.graphs`). Default: none."""

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

    def use_target(self, steps) -> None:
        """Before ``start``: ``steps`` (:class:`~draftlab.inference.decoder.TargetSteps`) runs the
        target over its own KV cache, for a proposer that drafts with the target itself. Default:
        not needed."""

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

    def use_target(self, steps) -> None:
        for p in self.rows:
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
    one-row one."""

    steps = None  # what use_target handed over

    def rows(self, n: int) -> RowProposers:
        raise NotImplementedError

    def batched(self, n: int, shape: Shape) -> RowProposers:
        return self.rows(n)

    def use_target(self, steps) -> None:
        self.steps = steps

    def start(self, prompt_ids, hidden, next_token) -> None:
        self._one = self.rows(1)
        self._one.configure(self.sampling)
        self._one.use_target(self.steps)
        self._one.start(0, prompt_ids, hidden, next_token)

    def propose(self, shape: Shape):
        return self._one.propose(shape)[0]

    def advance(self, accepted, hidden) -> None:
        self._one.advance([accepted], [hidden], [0])


def check_shape(shape, shapes: frozenset[str], drafter: str) -> None:
    """Refuse a shape whose kind is not among ``shapes`` (a proposer's), naming ``drafter``."""
    if not isinstance(shape, tuple(METHODS.values())):
        raise DraftlabError(f"shape must be one of {', '.join(c.__name__ for c in METHODS.values())}, got {shape!r}")
    if shape.kind not in shapes:
        raise DraftlabError(f"drafter '{drafter}' does not draft {shape.kind} shapes (it drafts: {', '.join(sorted(shapes)) or 'none'})")


# Proposer classes by drafter ``algorithm`` (built as ``cls(drafter)``), registered where they
# are defined; the training-free "ngram" is registered too but built with its own options.
PROPOSERS: Registry[type[Proposer]] = Registry("proposer")

# Training-free drafters other than "ngram" (which keeps its own flags), built by name
# (``--drafter NAME``) rather than from a checkpoint, registered where they are defined. Each
# class has ``from_options(options)``: it checks ``options`` (the ``--drafter-option`` KEY=VALUE
# pairs, values as strings; a one-line DraftlabError naming the bad one) before any model loads
# and returns the function that builds the proposer next to the loaded target.
FREE_DRAFTERS: Registry[type[Proposer]] = Registry("training-free drafter")


def load_proposer(checkpoint_dir, target, shape: Shape | None = None) -> Proposer:
    """The proposer of a drafter checkpoint, next to ``target``. With ``shape``, refuse (an
    :class:`OptionError` where an option is out of the drafter's range) a shape it cannot draft:
    a kind it does not draft, a tree wider than its vocabulary, what :meth:`Proposer.check` refuses."""
    from draftlab.checkpoint import load_drafter

    drafter, meta = load_drafter(checkpoint_dir, target)
    proposer = PROPOSERS.get(drafter.algorithm, f"{checkpoint_dir}: algorithm")(drafter)
    recipe = meta.get("recipe")
    loss = recipe.get("loss") if isinstance(recipe, dict) else None
    proposer.trained_depth = drafter.trained_depth(loss if isinstance(loss, dict) else {})
    proposer.draft_vocab = draft_vocab_size(drafter)
    if shape is not None:
        check_shape(shape, proposer.shapes, proposer.name)
        check_decoding(shape, draft_vocab=proposer.draft_vocab)
        proposer.check(shape, drafter)
    return proposer
