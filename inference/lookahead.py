"""Jacobi lookahead decoding (``--drafter lookahead``): training-free drafts from the target's own
Jacobi iterations, after Fu et al. 2024 (arXiv 2402.02057; hao-ai-lab/LookaheadDecoding).

The window. Each step's verify forward also runs the lookahead branch (a
:class:`~draftlab.inference.shapes.Branch`): a 2-D window of N-1 levels over C columns (C = W
once filled). Level 0's column 0 is the step's last token itself (the verify forward's first
input); level 0's other columns and every column of levels 1.. are the branch's inputs. Level l,
column c sits at the last token's position + l + c and sees the past, the level-0 tokens in
columns <= c and column c of levels 1..l: one contiguous run of positions, which it sees as a
plain forward over that run would.

After the forward (``on_logits``) the new level is the argmax of the top level's outputs (each the
guess for the position after its input); once the window is full each column's n-gram (its
level-0 token -> its tokens on levels 1..N-2 and the new one: N consecutive positions) goes to the
pool; then every token moves one position closer: the oldest level is dropped and level 1's
column 0 gives way to the next step's last token. As in lade (``ALWAYS_FWD_ONE``), the window moves
one position per step however many tokens were accepted: after a longer acceptance its tokens are
guesses for later positions than they were computed for, which the next iterations correct.
Warm-up, also as lade: level 0 starts as W+N-3 tokens drawn from the prompt (seeded by the prompt)
and the other levels fill in N-2 steps, each one column narrower, which leaves W columns.

The pool: key token -> at most G n-grams of N-1 tokens, the least recently added or seen one out
first (LRU). Option ``pool_from_prompt`` seeds it with the prompt's n-grams and adds those of the
kept text as it grows (lade's ``POOL_FROM_PROMPT``).

Drafts: the pool's n-grams after the last token. A tree merges them into a trie, most recent
first, within the shape's depth, children per node and total; a chain is the most recently added
or seen n-gram, cut to k. Unlike lade, guesses are verified from the first step (lade waits for the
window to fill). Drafts are point masses (``probs=None``): the verifier accepts x with p(x) and
on a rejection drops x from p and tries the next sibling, which is the paper's sampling rule
(App. B) for point-mass guesses, so sampling stays lossless. The window's update takes the argmax
of the lookahead logits under sampling too, as the paper does: a drafting choice only.
"""

from __future__ import annotations

import array
import functools
import random
import zlib

import torch

from draftlab.device import device_ints
from draftlab.errors import DraftlabError
from draftlab.inference.proposer import FREE_DRAFTERS, Branching, Proposer
from draftlab.inference.shapes import Branch, Chain, ChainDraft, DraftTree, DynamicTree

MAX_WINDOW = 64  # W
MAX_NGRAM = 16  # N
MAX_GUESSES = 64  # G


class NgramPool:
    """Key token -> at most ``size`` n-grams (tuples of the tokens after the key), the least
    recently added or seen first."""

    def __init__(self, size: int):
        self.size = size
        self.grams: dict[int, list[tuple[int, ...]]] = {}

    def add(self, key: int, gram: tuple[int, ...]) -> None:
        grams = self.grams.setdefault(key, [])
        if gram in grams:
            grams.remove(gram)
        elif len(grams) >= self.size:
            del grams[0]
        grams.append(gram)

    def add_run(self, tokens: list[int], n: int) -> None:
        """Every n-gram of ``tokens``, in order."""
        for i in range(len(tokens) - n + 1):
            self.add(tokens[i], tuple(tokens[i + 1 : i + n]))

    def get(self, key: int) -> list[tuple[int, ...]]:
        """The n-grams after ``key``, most recent first."""
        return self.grams.get(key, [])[::-1]


@functools.lru_cache(maxsize=64)
def window_layout(levels: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (offsets from the last token) and mask [E, E] of the branch inputs of a window of
    ``levels`` levels over ``columns`` columns, in their order: level 0's columns 1.., then each
    further level's columns 0... A level-0 input sees the level-0 inputs of columns up to its own;
    an input of level l >= 1 those too, and column c of levels 1..l."""
    cells = [(0, c) for c in range(1, columns)] + [(lv, c) for lv in range(1, levels) for c in range(columns)]
    level = torch.tensor([lv for lv, _ in cells], dtype=torch.long)
    column = torch.tensor([c for _, c in cells], dtype=torch.long)
    flat = (level[None] == 0) & (column[None] <= column[:, None])
    upward = (level[None] >= 1) & (column[None] == column[:, None]) & (level[None] <= level[:, None])
    return level + column, flat | upward


def branch_size(W: int, N: int) -> int:
    """The most inputs a window's branch holds: with s levels it spans W+N-1-s columns (s = N-1,
    full: W), i.e. s * (W+N-1-s) - 1 inputs (level 0's column 0 is the last token)."""
    return max(s * (W + N - 1 - s) - 1 for s in range(1, N))


def _trie(grams: list[tuple[int, ...]], shape: DynamicTree) -> tuple[list[int], list[int], list[int]]:
    """``grams`` merged into a trie (siblings distinct), in their order, within ``shape``'s depth,
    children per node and total: (tokens, parents, depth)."""
    tokens, parents, depth, kids = [], [], [0], [{}]  # node 0 = the root
    for gram in grams:
        node = 0
        for tok in gram[: shape.max_depth]:
            nxt = kids[node].get(tok)
            if nxt is None:
                if len(tokens) >= shape.max_nodes or len(kids[node]) >= shape.top_k:
                    break
                tokens.append(tok)
                parents.append(node)
                depth.append(depth[node] + 1)
                nxt = kids[node][tok] = len(tokens)
                kids.append({})
            node = nxt
    return tokens, parents, depth[1:]


def _flag(value: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(value)


@FREE_DRAFTERS.register("lookahead")
class LookaheadProposer(Proposer, Branching):
    """Options: ``W`` (window: columns, 1..MAX_WINDOW), ``N`` (n-gram size, 2..MAX_NGRAM; N-1
    levels), ``G`` (n-grams kept per key and so verified per step, 1..MAX_GUESSES),
    ``pool_from_prompt`` (seed the pool with the prompt's n-grams and add the kept text's).
    ``branch_inputs`` is :func:`branch_size`: (N-1)*W - 1 once the window is full (level 0's
    column 0 is the verify forward's last token), more during the warm-up when N-1 > W."""

    name = "lookahead"
    layers = ()
    shapes = frozenset({"chain", "dynamic_tree"})
    # option -> (parser of its --drafter-option string, what it expects)
    OPTIONS = {"W": (int, "an integer"), "N": (int, "an integer"), "G": (int, "an integer"),
               "pool_from_prompt": (_flag, "true or false")}

    def __init__(self, W: int = 7, N: int = 5, G: int = 7, pool_from_prompt: bool = False):
        is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
        for option, value, low, high, what in (("W", W, 1, MAX_WINDOW, "window"), ("N", N, 2, MAX_NGRAM, "n-gram size"),
                                               ("G", G, 1, MAX_GUESSES, "n-grams verified per step")):
            if not is_int(value) or not low <= value <= high:
                raise DraftlabError(f"lookahead drafter: {option} ({what}) must be an integer in {low}..{high}, got {value!r}")
        if not isinstance(pool_from_prompt, bool):
            raise DraftlabError(f"lookahead drafter: pool_from_prompt must be true or false, got {pool_from_prompt!r}")
        self.W, self.N, self.G, self.pool_from_prompt = W, N, G, pool_from_prompt
        self.branch_inputs = branch_size(W, N)

    @classmethod
    def from_options(cls, options: dict[str, str]):
        kwargs = {}
        for key, value in options.items():
            if key not in cls.OPTIONS:
                raise DraftlabError(f"--drafter-option {key}: not an option of drafter 'lookahead' (options: {', '.join(cls.OPTIONS)})")
            parse, what = cls.OPTIONS[key]
            try:
                kwargs[key] = parse(value)
            except ValueError:
                raise DraftlabError(f"--drafter-option {key}: expected {what}, got {value!r}") from None
        cls(**kwargs)  # every value checked before the target loads
        return lambda target: cls(**kwargs)

    # ---------------------------------------------------------------- protocol
    def start(self, prompt_ids: torch.Tensor, hidden: dict, next_token: int) -> None:
        self._device = prompt_ids.device
        prompt = prompt_ids.reshape(-1).tolist()
        # seeded by the prompt: reproducible, and nothing drawn from the decoder's generator
        rng = random.Random(zlib.crc32(array.array("q", prompt).tobytes()))
        self.levels: list[list[int]] = [[rng.choice(prompt) for _ in range(self.W + self.N - 3)]]  # level 0 from column 1
        self.pool = NgramPool(self.G)
        self.last = int(next_token)
        text = prompt + [self.last]
        if self.pool_from_prompt:
            self.pool.add_run(text, self.N)
        self._tail = text[-(self.N - 1) :]  # what the next kept token's n-gram starts with

    def advance(self, accepted: torch.Tensor, hidden: dict) -> None:
        new = accepted.reshape(-1).tolist()
        if not new:
            return
        self.last = new[-1]
        run = self._tail + new
        if self.pool_from_prompt:
            self.pool.add_run(run, self.N)
        self._tail = run[-(self.N - 1) :]

    def propose(self, shape: Chain | DynamicTree) -> ChainDraft | DraftTree:
        grams = self.pool.get(self.last)
        as_long = lambda x: device_ints(list(x), self._device)  # noqa: E731
        if isinstance(shape, Chain):
            draft = ChainDraft(as_long(list(grams[0][: shape.k]) if grams else []))
        else:
            draft = DraftTree(*map(as_long, _trie(grams, shape)))
        draft.branch = self._branch()
        return draft

    # ---------------------------------------------------------------- the window
    def _branch(self) -> Branch | None:
        levels, last = self.levels, self.last
        tokens = [t for level in levels for t in level]
        if not tokens:  # W = 1 and N = 2: no window
            return None
        positions, mask = window_layout(len(levels), len(levels[0]) + 1)
        return Branch(torch.tensor(tokens, dtype=torch.long), positions, mask, lambda logits: self._update(last, logits))

    def _update(self, last: int, logits: torch.Tensor) -> None:
        """The step's lookahead outputs ``logits`` [E, V] (``last``: its last token): the new level,
        the full window's n-grams into the pool, every token one position closer."""
        levels = self.levels
        top = levels[-1]
        # the new level by column; level 0's column 0 is the last token, whose output the verifier has
        new = ([None] if len(levels) == 1 else []) + logits[-len(top) :].argmax(-1).tolist()
        if len(levels) == self.N - 1:
            for c, tok in enumerate(new):
                if tok is not None:
                    key = last if c == 0 else levels[0][c - 1]
                    self.pool.add(key, tuple(level[c] for level in levels[1:]) + (tok,))
            shifted = levels[1:] + [new]  # the oldest level out; level 1's column 0 is the next last token
            self.levels = [shifted[0][1:]] + shifted[1:]
        else:  # filling: each level loses its column 0 (the next last token's), one more level
            self.levels = [level[1:] for level in levels] + [new[1:]]
