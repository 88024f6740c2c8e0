"""Draft-tree utilities: check a :class:`DraftTree` and build the ancestor-only attention of its
tree-verify forward (the decoder lays out tokens, depth positions and the kept path's KV-cache
slots, :mod:`draftlab.inference.decoder`). Dynamic and static trees (``proposer.DynamicTree`` / ``StaticTree``) are
drafted as the same :class:`DraftTree`, so they share one verify path.

Node numbering everywhere: node 0 is the root (the last verified token, not yet in the KV
cache), draft i of the tree is node i + 1, and a parent always precedes its children.
"""

from __future__ import annotations

import torch

from draftlab.inference.shapes import DraftTree


def validate_tree(tree: DraftTree, vocab_size: int | None = None) -> None:
    """Reject a malformed tree early: a wrong tree silently breaks losslessness or the cache.
    All checks are reduced on the tree's device and read back with one host sync."""
    n = tree.tokens.numel()
    if tree.parents.shape != (n,) or tree.depth.shape != (n,) or tree.tokens.shape != (n,):
        raise ValueError(f"draft tree: tokens, parents and depth must all be 1-D of length {n}")
    if n == 0:
        return
    node = torch.arange(1, n + 1, device=tree.parents.device)
    bad_parent = ((tree.parents < 0) | (tree.parents >= node)).any()
    full_depth = torch.cat([tree.depth.new_zeros(1), tree.depth])
    bad_depth = tree.depth != full_depth[tree.parents.clamp(0, n)] + 1
    bad_token = (tree.tokens < 0) | (tree.tokens >= vocab_size) if vocab_size is not None else tree.tokens < 0
    # Multi-candidate verification removes a rejected sibling's token from p: siblings must differ.
    key = (tree.parents.clamp(0, n) * (tree.tokens.max().clamp(min=0) + 1) + tree.tokens).sort().values
    dup = (key[1:] == key[:-1]).any()
    checks = torch.stack([bad_parent, bad_depth.any(), bad_token.any(), dup]).tolist()
    if checks[0]:
        raise ValueError("draft tree: every parent must be an earlier node (0 = root)")
    if checks[1]:
        raise ValueError("draft tree: depth must be the parent's depth + 1")
    if checks[2]:
        raise ValueError("draft tree: token id outside the target vocabulary")
    if checks[3]:
        raise ValueError("draft tree: siblings must carry distinct tokens")


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """Bool[N, N] over all nodes (root included, ``parents[0] == -1``): row i is True at i and
    at every ancestor of i (so at the root too). Equals ``eye(N)``, column 0 set, each row OR its
    parent's row."""
    n = parents.numel()
    mask = torch.eye(n, dtype=torch.bool, device=parents.device)
    rows = torch.arange(n, device=parents.device)
    cur = parents.clone()
    while bool((cur >= 0).any()):  # one pass per tree level
        live = cur >= 0
        mask[rows[live], cur[live]] = True
        cur = torch.where(live, parents[cur.clamp(min=0)], cur)
    return mask
