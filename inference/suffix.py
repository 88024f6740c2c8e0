"""Suffix-trie drafter (``--drafter suffix``): training-free retrieval of frequent continuations,
after SuffixDecoding (arXiv 2411.04975) and Ant's Lookahead (arXiv 2312.12728).

Every n-gram (n <= ``max_depth``) of the indexed token streams is a trie node holding its count:
a local trie per sequence (the prompt, then each token as it is accepted) and, optionally, a
corpus trie shared by every sequence: a corpus file tokenised with the target's tokenizer, built
once and cached on disk under a hash of its token ids and the trie options.

Drafting: in each trie, the longest suffix of the context that the trie holds with a
continuation, at most ``max_depth`` less the draft's depth tokens long (its continuations must fit
below it). From there, each continuation's score is the product along its path of
count(child) / Σ count(siblings): a chain takes the most frequent child step by step, a tree
grows best-first by score within the shape's depth, top-k and total; both stop where the score
falls below ``min_prob``. The trie whose draft has the larger total score (the expected accepted
tokens, were scores acceptance rates) wins.

Sampling: drafts are point masses (``probs=None``), lossless for any choice of tokens. The count
probabilities rank and stop drafts but are not handed to the verifier as q: a point mass x̂ is
accepted with probability p(x̂), a draw from q with Σ min(p, q), which is no larger wherever
p(x̂) >= (1 + q(x̂)) / 2, i.e. where the target is confident, as it is on the drafts retrieval gets
accepted. It also keeps one rule for chains and trees (a tree carries no probabilities).
"""

from __future__ import annotations

import array
import hashlib
import heapq
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from draftlab.device import device_ints
from draftlab.errors import DraftlabError
from draftlab.inference.proposer import FREE_DRAFTERS, Proposer
from draftlab.inference.shapes import Chain, ChainDraft, DraftTree, DynamicTree

FORMAT = "draftlab-suffix-trie/1"
MAX_DEPTH = 256


class _Node:
    __slots__ = ("count", "last", "kids")

    def __init__(self):
        self.count, self.last, self.kids = 0, 0, {}  # last: start position of the latest occurrence


class SuffixTrie:
    """Every n-gram (n <= ``depth``) of the streams inserted, with its count, in at most
    ``max_nodes`` nodes besides the root.

    Pruning: before an insertion that could exceed ``max_nodes``, nodes are dropped until at most
    3/4 of it remain: the least counted first; among equal counts, the n-gram last seen at the
    earliest position; then the deeper one. A node's count and last position never exceed its
    parent's, so a node sorts before its parent and whole subtrees go. The n-grams starting in the
    last ``depth`` positions stay: they are the live suffixes the next token extends."""

    def __init__(self, depth: int, max_nodes: int):
        self.depth, self.max_nodes = depth, max_nodes
        self.root = _Node()
        self.size = 0
        self.clock = 0  # positions inserted so far, over every stream

    def insert(self, live: list[_Node], tokens) -> list[_Node]:
        """Append ``tokens`` to a stream whose live suffixes are ``live`` (the nodes of its last 1,
        2, ..., depth - 1 tokens; [] starts a stream), counting every n-gram each token ends.
        Returns the new live suffixes."""
        for tok in tokens:
            if self.size + self.depth > self.max_nodes:
                self.prune()
            pos, self.clock = self.clock, self.clock + 1
            grown = []
            for n, node in enumerate([self.root, *live]):  # node: the suffix of n tokens
                child = node.kids.get(tok)
                if child is None:
                    child = node.kids[tok] = _Node()
                    self.size += 1
                child.count += 1
                child.last = pos - n
                grown.append(child)
            live = grown[: self.depth - 1]
        return live

    def remove(self, tokens) -> None:
        """Forget a whole stream inserted before (``insert([], tokens)``, in one call or several):
        every n-gram it counted loses that count, and n-grams no stream holds any more go, so a
        corpus can slide over a window of streams. An n-gram pruning already dropped stays
        dropped."""
        tokens = list(tokens)
        for start in range(len(tokens)):
            node = self.root
            for tok in tokens[start : start + self.depth]:
                child = node.kids.get(tok)
                if child is None:
                    break
                child.count -= 1
                if child.count <= 0:  # its descendants counted only this occurrence: they go with it
                    self.size -= _subtree_size(node.kids.pop(tok))
                    break
                node = child

    def prune(self) -> None:
        entries = []
        stack = [(self.root, 0)]
        while stack:
            node, d = stack.pop()
            for tok, child in node.kids.items():
                if child.last <= self.clock - self.depth:
                    entries.append((child.count, child.last, -d - 1, len(entries), node, tok))
                stack.append((child, d + 1))
        entries.sort()
        dropped = entries[: self.size - self.max_nodes * 3 // 4]
        for *_, parent, tok in dropped:
            parent.kids.pop(tok, None)  # None: it went with an ancestor
        self.size -= len(dropped)

    def match(self, tail: list[int], longest: int) -> _Node | None:
        """The node of the longest suffix of ``tail`` (at most ``longest`` tokens) that has a continuation."""
        for m in range(min(longest, len(tail)), 0, -1):
            node = self.root
            for tok in tail[-m:]:
                node = node.kids.get(tok)
                if node is None:
                    break
            if node is not None and node.kids:
                return node
        return None

    # ------------------------------------------------------------------ on disk (safetensors)
    def to_bytes(self, key: str) -> bytes:
        from safetensors.torch import save

        order, cols = [self.root], {"parent": [], "token": [], "count": []}
        for i, node in enumerate(order):  # breadth first: a parent precedes its children
            for tok, child in node.kids.items():
                order.append(child)
                for name, v in zip(cols, (i, tok, child.count)):
                    cols[name].append(v)
        return save({k: torch.tensor(v, dtype=torch.int64) for k, v in cols.items()}, metadata={"format": FORMAT, "key": key})

    @classmethod
    def load(cls, path: Path, depth: int, max_nodes: int, key: str) -> "SuffixTrie | None":
        """The trie cached at ``path`` under ``key``; None when absent or unreadable (rebuilt then)."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), "pt") as f:
                if f.metadata() != {"format": FORMAT, "key": key}:
                    return None
                cols = [f.get_tensor(k).tolist() for k in ("parent", "token", "count")]
            trie, nodes = cls(depth, max_nodes), []
            nodes.append(trie.root)
            for parent, tok, count in zip(*cols):
                node = nodes[parent].kids[tok] = _Node()
                node.count = count
                nodes.append(node)
        except (OSError, SafetensorError, IndexError, KeyError, TypeError):
            return None
        trie.size = len(nodes) - 1
        return trie


def _subtree_size(node: _Node) -> int:
    size, stack = 0, [node]
    while stack:
        n = stack.pop()
        size += 1
        stack.extend(n.kids.values())
    return size


# ---------------------------------------------------------------------- drafting from a node
def _ranked(node: _Node, top: int) -> list:
    """(token, child) of the ``top`` most counted children, the most recently seen among equals."""
    return heapq.nlargest(top, node.kids.items(), key=lambda kv: (kv[1].count, kv[1].last))


def _chain(node: _Node, k: int, min_prob: float) -> tuple[float, list[int]]:
    tokens, p = [], 1.0
    score = 0.0
    while len(tokens) < k and node.kids:
        total = sum(c.count for c in node.kids.values())
        tok, child = _ranked(node, 1)[0]
        p *= child.count / total
        if p < min_prob:
            break
        tokens.append(tok)
        score += p
        node = child
    return score, tokens


def _tree(node: _Node, shape: DynamicTree, min_prob: float) -> tuple[float, list[int], list[int], list[int]]:
    tokens, parents, depth = [], [], []
    heap, tie = [], itertools.count()

    def expand(node: _Node, p: float, parent: int, d: int) -> None:
        total = sum(c.count for c in node.kids.values())
        for tok, child in _ranked(node, shape.top_k):
            q = p * child.count / total
            if q >= min_prob:
                heapq.heappush(heap, (-q, next(tie), tok, child, parent, d))

    expand(node, 1.0, 0, 1)
    score = 0.0
    while heap and len(tokens) < shape.total_tokens:  # scores fall along a path: parents come first
        neg, _, tok, child, parent, d = heapq.heappop(heap)
        tokens.append(tok)
        parents.append(parent)
        depth.append(d)
        score -= neg
        if d < shape.max_depth and child.kids:
            expand(child, -neg, len(tokens), d + 1)
    return score, tokens, parents, depth


# ---------------------------------------------------------------------- the corpus
@dataclass
class Corpus:
    """A corpus file, checked when read (before any model loads). A recipe YAML (``.yaml``,
    ``.yml``) stands for its training responses: the assistant tokens of its data's training
    split, a document per turn (the held-out split stays out, so evaluating on it stays fair). A
    ``.jsonl`` file holds an object a line: ``{"text": str}``, ``{"token_ids": [int, ...]}`` or a
    chat, ``{"messages": [...]}`` or ShareGPT ``{"conversations": [...]}``, whose assistant turns
    are documents. Any other file is one UTF-8 text document."""

    path: Path
    documents: list[tuple[int, str | list[int]]]  # (line, text or token ids)
    data: object = None  # a recipe's data section

    @classmethod
    def read(cls, path) -> "Corpus":
        from draftlab.atomic import reason

        path = Path(path)
        if path.suffix in (".yaml", ".yml"):
            from draftlab.recipe import load_recipe

            return cls(path, [], load_recipe(path).data)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise DraftlabError(f"corpus {path}: cannot read ({reason(e)})") from None
        nul = data.find(b"\0")
        if nul >= 0:
            raise DraftlabError(f"corpus {path}: not a text file (NUL byte at byte {nul + 1})")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DraftlabError(f"corpus {path}: not UTF-8 text (byte 0x{data[e.start]:02x} at byte {e.start + 1})") from None
        docs = [(n, d) for n, d in (_jsonl_documents(text, path) if path.suffix == ".jsonl" else [(1, text)]) if len(d)]
        if not docs:
            raise DraftlabError(f"corpus {path}: holds no text")
        return cls(path, docs)

    def token_ids(self, target) -> list[list[int]]:
        if self.data is not None:
            from draftlab.data.dataset import build_samples

            runs = []
            for s in build_samples(self.data, target.tokenizer, target=target).train:
                for keep, run in itertools.groupby(zip(s["input_ids"].tolist(), s["loss_mask"].tolist()), key=lambda x: x[1]):
                    runs += [[t for t, _ in run]] if keep else []
            return runs
        out = []
        for n, doc in self.documents:
            out.append(target.tokenizer.encode(doc, add_special_tokens=False) if isinstance(doc, str) else doc)
            top, vocab = max(out[-1], default=0), target.vocab_size
            if top >= vocab:
                raise DraftlabError(f"corpus {self.path}:{n}: token id {top} is outside the target's vocabulary ({vocab} tokens)")
        return out


def _jsonl_documents(text: str, path: Path) -> list[tuple[int, str | list[int]]]:
    from draftlab.inference.prompts import valid_text

    docs = []
    for n, line in enumerate(text.splitlines(), 1):
        where = f"corpus {path}:{n}"
        try:
            rec = json.loads(line) if line.strip() else {"text": ""}
        except (ValueError, RecursionError) as e:
            raise DraftlabError(f"{where}: not valid JSON ({getattr(e, 'msg', 'nested too deeply')})") from None
        rec = rec if isinstance(rec, dict) else {}
        turns, ids = rec.get("messages", rec.get("conversations")), rec.get("token_ids")
        if isinstance(rec.get("text"), str):
            docs.append((n, valid_text(rec["text"], where)))
        elif isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            docs.append((n, ids))
        elif isinstance(turns, list) and all(isinstance(t, dict) for t in turns):
            for t in turns:
                role, content = t.get("role", t.get("from")), t.get("content", t.get("value"))
                if role in ("assistant", "gpt") and isinstance(content, str):
                    docs.append((n, valid_text(content, where)))
        else:
            raise DraftlabError(f"{where}: expected an object with 'text' (a string), 'token_ids' (integers >= 0), "
                                "or 'messages' / 'conversations' (chat turns)")
    return docs


# ---------------------------------------------------------------------- the proposer
@FREE_DRAFTERS.register("suffix")
class SuffixProposer(Proposer):
    """Options: ``max_depth`` (longest n-gram indexed, 2..MAX_DEPTH), ``max_nodes`` (per trie, at
    least max_depth², so pruning always leaves room for the live suffixes), ``min_prob`` (in
    [0, 1]; 0 = draft as far as the shape allows), ``corpus`` (a file, see :class:`Corpus`; needs
    ``target``, whose tokenizer reads it)."""

    name = "suffix"
    layers = ()
    shapes = frozenset({"chain", "dynamic_tree"})
    OPTIONS = {"max_depth": int, "max_nodes": int, "min_prob": float, "corpus": str}

    def __init__(self, max_depth: int = 24, max_nodes: int = 1 << 20, min_prob: float = 0.1, corpus=None, target=None):
        def bad(option, detail, value):
            raise DraftlabError(f"suffix drafter: {option} must be {detail}, got {value!r}")

        is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
        if not is_int(max_depth) or not 2 <= max_depth <= MAX_DEPTH:
            bad("max_depth", f"an integer in 2..{MAX_DEPTH}", max_depth)
        if not is_int(max_nodes) or not max_depth**2 <= max_nodes < 2**40:
            bad("max_nodes", f"an integer of at least max_depth² ({max_depth**2})", max_nodes)
        if isinstance(min_prob, bool) or not isinstance(min_prob, (int, float)) or not 0.0 <= min_prob <= 1.0:
            bad("min_prob", "a number in [0, 1]", min_prob)
        if corpus is not None and target is None:
            raise DraftlabError("suffix drafter: a corpus needs the target (its tokenizer reads the corpus)")
        self.max_depth, self.max_nodes, self.min_prob = max_depth, max_nodes, float(min_prob)
        self.corpus, self.corpus_cache, self.corpus_from_cache = None, None, False
        if corpus is not None:
            self._load_corpus(corpus if isinstance(corpus, Corpus) else Corpus.read(corpus), target)

    @classmethod
    def from_options(cls, options: dict[str, str]):
        kwargs = {}
        for key, value in options.items():
            kind = cls.OPTIONS.get(key)
            if kind is None:
                raise DraftlabError(f"--drafter-option {key}: not an option of drafter 'suffix' (options: {', '.join(cls.OPTIONS)})")
            try:
                kwargs[key] = kind(value)
            except ValueError:
                raise DraftlabError(f"--drafter-option {key}: expected {kind.__name__}, got {value!r}") from None
        corpus = Corpus.read(kwargs.pop("corpus")) if "corpus" in kwargs else None
        cls(**kwargs)  # every value checked before the target loads
        return lambda target: cls(**kwargs, corpus=corpus, target=target)

    def _load_corpus(self, corpus: Corpus, target) -> None:
        """The corpus trie, from the cache when it holds one for these token ids and options."""
        from draftlab.atomic import write_bytes
        from draftlab.models.target import cache_root

        docs = corpus.token_ids(target)
        h = hashlib.sha256(json.dumps([FORMAT, self.max_depth, self.max_nodes]).encode())
        for ids in docs:
            h.update(len(ids).to_bytes(8, "little") + array.array("q", ids).tobytes())
        key = h.hexdigest()
        self.corpus_cache = cache_root() / "suffix" / f"{key}.safetensors"
        self.corpus = SuffixTrie.load(self.corpus_cache, self.max_depth, self.max_nodes, key)
        self.corpus_from_cache = self.corpus is not None
        if self.corpus is None:
            self.corpus = SuffixTrie(self.max_depth, self.max_nodes)
            for ids in docs:
                self.corpus.insert([], ids)
            write_bytes(self.corpus_cache, self.corpus.to_bytes(key))

    # ---------------------------------------------------------------- protocol
    def start(self, prompt_ids: torch.Tensor, hidden: dict, next_token: int) -> None:
        self._device = prompt_ids.device
        self.local = SuffixTrie(self.max_depth, self.max_nodes)  # forks share only the corpus trie
        self._live, self._tail = [], []
        self._append(prompt_ids.reshape(-1).tolist() + [int(next_token)])

    def advance(self, accepted: torch.Tensor, hidden: dict) -> None:
        self._append(accepted.reshape(-1).tolist())

    def propose(self, shape: Chain | DynamicTree) -> ChainDraft | DraftTree:
        chain = isinstance(shape, Chain)
        longest = max(1, self.max_depth - (shape.k if chain else shape.max_depth))
        nodes = [next((n for n in reversed(self._live[:longest]) if n.kids), None)]
        if self.corpus is not None:
            nodes.append(self.corpus.match(self._tail, longest))
        drafts = [_chain(n, shape.k, self.min_prob) if chain else _tree(n, shape, self.min_prob) for n in nodes if n]
        best = max(drafts, key=lambda d: d[0], default=(0.0, [], [], []))  # ties: the local trie
        as_long = lambda x: device_ints(list(x), self._device)  # noqa: E731
        return ChainDraft(as_long(best[1])) if chain else DraftTree(*map(as_long, best[1:4]))

    def _append(self, ids: list[int]) -> None:
        self._live = self.local.insert(self._live, ids)
        self._tail = (self._tail + ids)[-self.max_depth :]
