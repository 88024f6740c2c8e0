"""The decoding spec: the options of a decoding run (draft shape, sampling, batch sizes, the plain
baseline, CUDA graphs), one type whether a recipe's ``eval:`` section or the ``draftlab eval`` /
``draftlab generate`` flags set them, and :func:`check_spec`, the one check of it.

The bounds are :mod:`draftlab.limits`' (through the draft shapes and ``check_decoding``); the
rules tie options together (a static tree needs its choices, an adaptive draft length needs
batch sizes, ...). Every error is one line naming the option as its user set it: ``names`` maps
a field (``k``, ``tree.depth``, ``static_tree``, ...) to a flag (``--k``) or to a recipe field
(``eval.k``, :func:`field_names`).
"""

from __future__ import annotations

from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from draftlab.errors import DraftlabError
from draftlab.inference.shapes import (
    CHOICES_EXAMPLE, Block, Chain, DynamicTree, OptionError, Shape, StaticTree, check_decoding,
)

# the options check_spec names, as fields; ``names`` also words ``no_baseline`` (the baseline off)
OPTIONS = ("method", "k", "min_confidence", "tree.depth", "tree.top_k", "tree.total_tokens", "static_tree", "max_new_tokens",
           "temperature", "top_k", "top_p", "batch_sizes", "adaptive", "cuda_graphs", "seed")


class TreeSpec(BaseModel):
    """A dynamic tree's fields (:class:`~draftlab.inference.shapes.DynamicTree`)."""

    model_config = ConfigDict(extra="forbid")
    depth: StrictInt = DynamicTree.depth
    top_k: StrictInt = DynamicTree.top_k
    total_tokens: StrictInt = DynamicTree.total_tokens


class DecodingSpec(BaseModel):
    """What to decode with. Types only: the bounds and rules are :func:`check_spec`'s."""

    model_config = ConfigDict(extra="forbid")
    method: Literal["chain", "tree", "static_tree", "block"] = Field(
        "chain", description="draft shape: chain, tree (EAGLE-2 dynamic tree), static_tree or block"
    )
    k: StrictInt = Field(5, description="chain and block: drafts per step")
    min_confidence: float = Field(
        0.0, description="chain: stop drafting once the product of the drafter's top-1 probabilities falls below this; "
        "block: cut the block where the product of its predicted acceptances does (drafters with a confidence head)"
    )
    tree: TreeSpec = TreeSpec()
    # any list: check_spec names a bad path or rank (a bool is no rank), which a typed list would not
    static_tree: list[Any] | None = Field(
        None, description="static_tree: paths of candidate ranks from the root, e.g. [[0], [1], [0, 0]]"
    )
    max_new_tokens: StrictInt = 128
    temperature: float = Field(0.0, description="0 = greedy")
    top_k: StrictInt = Field(0, description="0 = off")
    top_p: float = 1.0
    baseline: StrictBool = Field(True, description="also time plain decoding for the speedup")
    batch_sizes: list[StrictInt] | None = Field(
        None, description="also measure speedup by batch size on the same prompts, e.g. [1, 4, 16] (needs baseline)"
    )
    adaptive: StrictBool = Field(False, description="with batch_sizes: choose the chain's or block's draft length per step")
    cuda_graphs: StrictBool = Field(
        False, description="replay the target's (and a draft LM's) decoding forwards as CUDA graphs: plain and speculative alike (CUDA only)"
    )

    def shape(self) -> Shape:
        """The draft shape asked for (of a spec :func:`check_spec` passed)."""
        if self.method == "chain":
            return Chain(self.k, self.min_confidence)
        if self.method == "block":
            return Block(self.k, self.min_confidence)
        if self.method == "tree":
            return DynamicTree(**self.tree.model_dump())
        return StaticTree(self.static_tree)


def field_names(prefix: str) -> dict[str, str]:
    """``names`` for a spec read as a section of a file: ``prefix`` + the field (``eval.k``)."""
    return {**{o: prefix + o for o in OPTIONS}, "seed": "seed", "no_baseline": f"{prefix}baseline false"}


def named(e: OptionError, names: Mapping[str, str]) -> OptionError:
    """``e`` worded with the caller's name of its option (a static tree's errors name the tree)."""
    if e.option == "static_tree":
        return OptionError(e.option, e.detail, f"{names.get(e.option, e.option)}: {e}")
    return e.renamed(names)


def check_spec(spec: DecodingSpec, names: Mapping[str, str] | None = None, *, seed: int = 0, device=None) -> None:
    """The one check of a decoding spec, before any model loads: a one-line DraftlabError naming
    the first option out of bounds or breaking a rule, by its name in ``names``. Every bounded
    field is checked whatever the method (a typo in a field the method does not use is still
    one). ``seed``: the run's; ``device`` (when known): where the target decodes, for
    ``cuda_graphs``. What depends on the models (a tree's top-k against the draft vocabulary,
    the new tokens against the target's positions) is ``check_decoding``'s, once they are loaded."""
    names = names or {}

    def n(option: str) -> str:
        return names.get(option, option)

    try:
        Chain(spec.k, spec.min_confidence)
        DynamicTree(**spec.tree.model_dump())
        check_decoding(None, spec.max_new_tokens, spec.temperature, spec.top_k, spec.top_p, spec.batch_sizes, seed)
    except OptionError as e:
        raise named(e, names) from None
    if spec.static_tree is not None and spec.method != "static_tree":
        raise DraftlabError(f"{n('static_tree')} applies to {n('method')} static_tree")
    if spec.min_confidence and spec.method not in ("chain", "block"):
        raise DraftlabError(f"{n('min_confidence')} sets a chain's or block's draft length: use {n('method')} chain or block")
    if spec.method == "static_tree":
        if spec.static_tree is None:
            raise DraftlabError(f"{n('method')} static_tree needs {n('static_tree')} (paths of candidate ranks, e.g. '{CHOICES_EXAMPLE}')")
        try:
            StaticTree(spec.static_tree)
        except OptionError as e:
            raise named(e, names) from None
    if spec.batch_sizes is not None and not spec.baseline:
        raise DraftlabError(f"{n('batch_sizes')} measures speedup over plain batched decoding: drop {n('no_baseline')}")
    if spec.adaptive and (spec.batch_sizes is None or spec.method not in ("chain", "block")):
        raise DraftlabError(f"{n('adaptive')} chooses a chain's or block's draft length per step: it needs {n('batch_sizes')} "
                            f"and {n('method')} chain or block")
    if spec.cuda_graphs and device is not None and str(device).split(":")[0] != "cuda":
        raise DraftlabError(f"{n('cuda_graphs')}: CUDA graphs need the target on a CUDA device, not {device}")
