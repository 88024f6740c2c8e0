"""Draft-tree utilities: turn a :class:`DraftTree` into the inputs of one tree-verify forward
(tokens, ancestor-only attention, depth positions) and map the verifier's accepted path back
to KV-cache slots. Dynamic and static trees (``proposer.DynamicTree`` / ``StaticTree``) are
drafted as the same :class:`DraftTree`, so they share one verify path.

Node numbering everywhere: node 0 is the root (the last verified token, not yet in the KV
cache), draft i of the tree is node i + 1, and a parent always precedes its children.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftlab.inference.proposer import DraftTree


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


@dataclass
class TreeVerifyInputs:
    """One tree-verify forward, root included (N + 1 nodes)."""

    tokens: torch.Tensor  # Long[N+1]: root token, then the drafts
    parents: torch.Tensor  # Long[N+1]: -1 for the root
    depth: torch.Tensor  # Long[N+1]: 0 for the root
    mask: torch.Tensor  # Bool[N+1, N+1] ancestor-only attention among the new tokens

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    def attn_mask(self, past: int) -> torch.Tensor:
        """Bool[1, N+1, past+N+1] for ``Target.forward``: the whole cached prefix, then the tree."""
        n = self.tokens.numel()
        prefix = torch.ones(n, past, dtype=torch.bool, device=self.mask.device)
        return torch.cat([prefix, self.mask], dim=1)[None]

    def position_ids(self, past: int) -> torch.Tensor:
        """Long[1, N+1]: cache length + depth (the root sits at position ``past``)."""
        return (past + self.depth)[None]


def tree_verify_inputs(root_token: int, tree: DraftTree) -> TreeVerifyInputs:
    device = tree.tokens.device
    tokens = torch.cat([torch.tensor([root_token], dtype=torch.long, device=device), tree.tokens.long()])
    parents = torch.cat([torch.tensor([-1], dtype=torch.long, device=device), tree.parents.long()])
    depth = torch.cat([torch.zeros(1, dtype=torch.long, device=device), tree.depth.long()])
    # The mask walk loops once per level: do it on the host (tens of nodes) and copy once.
    mask = ancestor_mask(parents.cpu()).to(device)
    return TreeVerifyInputs(tokens, parents, depth, mask)


def accepted_slots(start: int, path: torch.Tensor, num_accepted: int) -> torch.Tensor:
    """Absolute KV-cache slots of the kept path (root + ``num_accepted`` nodes): the tree's node
    n was written at slot ``start + n``; ascending because a parent precedes its children."""
    return start + path[: num_accepted + 1].long()
