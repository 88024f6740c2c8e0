"""Plain PyTorch references for the verify kernels (the spec the Triton kernels must match).

Every function here is called through :mod:`draftlab.kernels`, which validates the inputs and
computes the batch layout (``kmax`` for chains; ``depth``/``max_depth`` for trees) first; see
that module's docstring for the tensor layouts. These references are vectorised over the batch
(a statistical test runs 1e5 requests in one call) and loop only where the algorithm is
sequential: over tree node indices.

Numerics shared with the Triton kernels, bit for bit:
- probabilities are used as float32 (``.float()``, exactly what the kernels load), acceptance
  ratios are formed in float64 and compared with float64 uniforms;
- a sampled token is ``argmax(r / E)`` in float32 over a non-negative, unnormalised residual r and
  Exp(1) noise E (Gumbel-max in exponential form); ties go to the lowest token id (torch.argmax
  and the kernels' block-wise argmax both keep the first maximum).
"""

from __future__ import annotations

import torch


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(p - q, 0): the distribution (unnormalised) to recover from after rejecting a draft."""
    return torch.clamp(p - q, min=0.0)


def _remove_tokens(r: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """r with r[b, tokens[b, k]] = 0 wherever mask[b, k]: drop rejected candidates' mass."""
    vocab = r.shape[-1]
    # masked-off entries scatter into a spare column that is then cut away
    idx = torch.where(mask, tokens, torch.full_like(tokens, vocab))
    padded = torch.cat([r, r.new_zeros(r.shape[0], 1)], dim=1)
    return padded.scatter(1, idx, 0.0)[:, :vocab]


def _ragged(flat: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, width: int, fill):
    """Gather flat[starts[b] + j] for j < lengths[b] into a [B, width] tensor padded with fill."""
    j = torch.arange(width, device=starts.device)
    valid = j < lengths[:, None]
    idx = (starts[:, None] + j).clamp(max=max(flat.shape[0] - 1, 0))
    vals = flat[idx] if flat.shape[0] else flat.new_full(idx.shape, fill)
    return torch.where(valid, vals, torch.full_like(vals, fill))


def _accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """Number of leading True values per row."""
    return accept.long().cumprod(dim=1).sum(dim=1)


def _chain_output(drafts: torch.Tensor, num_accepted: torch.Tensor, emitted: torch.Tensor):
    """[B, Kmax+1]: accepted drafts, then the emitted (correction/bonus) token, then -1."""
    batch, kmax = drafts.shape
    j = torch.arange(kmax + 1, device=drafts.device)
    padded = torch.cat([drafts, drafts.new_full((batch, 1), -1)], dim=1)
    out = torch.where(j < num_accepted[:, None], padded, torch.full_like(padded, -1))
    out[torch.arange(batch, device=drafts.device), num_accepted] = emitted
    return out


def chain_verify_greedy(draft_ids, cu_num_draft, target_argmax, kmax: int):
    starts, lengths = cu_num_draft[:-1], cu_num_draft[1:] - cu_num_draft[:-1]
    batch = lengths.shape[0]
    ar = torch.arange(batch, device=draft_ids.device)
    drafts = _ragged(draft_ids, starts, lengths, kmax, -1)
    # request b's target rows start at cu[b] + b (one extra, bonus, row per earlier request)
    targets = _ragged(target_argmax, starts + ar, lengths + 1, kmax + 1, -1)
    valid = torch.arange(kmax, device=draft_ids.device) < lengths[:, None]
    num_accepted = _accepted_prefix(valid & (drafts == targets[:, :kmax]))
    return _chain_output(drafts, num_accepted, targets[ar, num_accepted]), num_accepted


def chain_verify_sampling(draft_ids, cu_num_draft, target_probs, draft_probs, uniforms, exp_noise,
                          kmax: int):
    starts, lengths = cu_num_draft[:-1], cu_num_draft[1:] - cu_num_draft[:-1]
    batch = lengths.shape[0]
    device = draft_ids.device
    ar = torch.arange(batch, device=device)
    p = target_probs.float()
    q = None if draft_probs is None else draft_probs.float()
    drafts = _ragged(draft_ids, starts, lengths, kmax, -1)
    valid = torch.arange(kmax, device=device) < lengths[:, None]
    tok = drafts.clamp(min=0)  # padding gathers token 0, masked out by `valid`
    draft_rows = _ragged(torch.arange(draft_ids.shape[0], device=device), starts, lengths, kmax, 0)
    target_rows = draft_rows + ar[:, None]
    p_tok = p[target_rows, tok]
    q_tok = torch.ones_like(p_tok) if q is None else q[draft_rows, tok]
    u = uniforms.double()[draft_rows]
    # q(x) == 0 means x could not have been drafted from q: reject rather than divide by zero
    accept = valid & (q_tok > 0) & (u <= p_tok.double() / q_tok.double())
    num_accepted = _accepted_prefix(accept)

    rejected = num_accepted < lengths
    row = starts + ar + num_accepted  # target row of the emitted token
    p_row = p[row]
    if q is None:
        # point-mass q: one-hot of the rejected draft; none (-1: pure bonus) if all accepted
        rej_tok = torch.cat([drafts, drafts.new_full((batch, 1), -1)], dim=1)[ar, num_accepted]
        q_row = (torch.arange(p.shape[1], device=device) == rej_tok[:, None]).float()
    elif kmax == 0:
        q_row = torch.zeros_like(p_row)
    else:
        q_rows = q[(starts + num_accepted).clamp(max=draft_ids.shape[0] - 1)]
        q_row = torch.where(rejected[:, None], q_rows, torch.zeros_like(q_rows))
    emitted = torch.argmax(_residual(p_row, q_row) / exp_noise[row].float(), dim=1)
    return _chain_output(drafts, num_accepted, emitted), num_accepted


def _tree_walk(parents, accept_child):
    """The walk shared by both tree verifiers. Nodes are visited in index order and node c is
    tried iff its parent is the current node: children always follow their parent, so one pass
    tries every child of every node the walk reaches, in index order, and skips the siblings left
    behind. ``accept_child(c, cur, child_mask)`` returns the acceptance mask of node c.
    Returns (accepted: Bool[B, N] with the root marked, cur: the last accepted node)."""
    batch, n = parents.shape
    cur = torch.zeros(batch, dtype=torch.long, device=parents.device)
    accepted = torch.zeros(batch, n, dtype=torch.bool, device=parents.device)
    accepted[:, 0] = True
    for c in range(1, n):
        acc = accept_child(c, cur, parents[:, c] == cur)
        accepted[:, c] = acc
        cur = torch.where(acc, c, cur)
    return accepted, cur


def _tree_output(accepted, tree_tokens, max_depth: int, emitted):
    """path/out [B, D+1] from the accepted nodes. Accepted nodes form a root path, and indices
    grow along a path, so the k-th accepted node (in index order) is the one at depth k."""
    batch, n = accepted.shape
    depth_slot = torch.where(accepted, accepted.long().cumsum(1) - 1, max_depth + 1)
    nodes = torch.arange(n, device=accepted.device).expand(batch, n)
    path = torch.full((batch, max_depth + 2), -1, dtype=torch.long, device=accepted.device)
    path = path.scatter(1, depth_slot, nodes)[:, :max_depth + 1]  # column D+1 collects the rest
    num_accepted = accepted.long().sum(1) - 1
    # out[k] = token of the node at depth k+1, then the emitted token
    out = torch.full((batch, max_depth + 2), -1, dtype=torch.long, device=accepted.device)
    draft_slot = torch.where(accepted[:, 1:], depth_slot[:, 1:] - 1, max_depth + 1)
    out = out.scatter(1, draft_slot, tree_tokens[:, 1:])
    out[torch.arange(batch, device=accepted.device), num_accepted] = emitted
    return path, out[:, :max_depth + 1], num_accepted


def tree_verify_greedy(tree_tokens, parents, target_argmax, max_depth: int):
    ar = torch.arange(tree_tokens.shape[0], device=tree_tokens.device)

    def accept_child(c, cur, child):
        return child & (tree_tokens[:, c] == target_argmax[ar, cur])

    accepted, cur = _tree_walk(parents, accept_child)
    return _tree_output(accepted, tree_tokens, max_depth, target_argmax[ar, cur])


def tree_verify_sampling(tree_tokens, parents, target_probs, uniforms, exp_noise, max_depth: int):
    batch, n = tree_tokens.shape
    ar = torch.arange(batch, device=tree_tokens.device)
    p = target_probs.float()
    u = uniforms.double()
    node_mass = p.double().sum(dim=2)  # [B, N], float64
    # sum of the residual at the current node, in float64: sum(p[cur]) minus the target
    # probability of every sibling rejected so far (siblings carry distinct tokens)
    state = {"total": node_mass[:, 0]}

    def accept_child(c, cur, child):
        p_tok = p[ar, cur, torch.where(child, tree_tokens[:, c], 0)].double()
        acc = child & (u[:, c] <= p_tok / state["total"])
        total = torch.where(child & ~acc, state["total"] - p_tok, state["total"])
        state["total"] = torch.where(acc, node_mass[:, c], total)
        return acc

    accepted, cur = _tree_walk(parents, accept_child)
    # the walk stops at cur either at a leaf (r = p) or after rejecting every child of cur
    # (r = p without the children's tokens): one formula covers bonus and correction
    children = (parents == cur[:, None]) & (torch.arange(n, device=parents.device) > 0)
    r = _remove_tokens(p[ar, cur], tree_tokens.clamp(min=0), children)
    emitted = torch.argmax(r / exp_noise[ar, cur].float(), dim=1)
    return _tree_output(accepted, tree_tokens, max_depth, emitted)
