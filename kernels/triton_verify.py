"""Triton verify kernels: one program per request, vocabulary processed in blocks.

Called through :mod:`draftlab.kernels` (which validates inputs and documents the layouts); each
kernel matches its :mod:`draftlab.kernels.reference` counterpart exactly: probabilities are
loaded and used as float32, uniforms and acceptance ratios are float64, the float32 score r / E
uses IEEE round-to-nearest division (``div_rn``; Triton's plain ``/`` may be approximate on
GPUs, torch's is not), and the block-wise argmax keeps the first maximum (lowest token id), like
torch.argmax.

On CPU these kernels run only in Triton's interpreter, and ``TRITON_INTERPRET=1`` must be set
before ``triton`` is first imported: Triton decides interpreter vs compiler when a function is
decorated, and its own ``tl.*`` library functions are decorated at ``import triton``.
:data:`INTERPRETED` records which mode this process got.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

# Largest vocabulary block per loop step (tests lower it to exercise the multi-block argmax).
MAX_BLOCK_V = 1024
# Cap on BLOCK_V * BLOCK_N for the tree correction's [BLOCK_V, BLOCK_N] token-membership test.
_TREE_TILE = 16384


def _float_input(t: torch.Tensor) -> torch.Tensor:
    """Contiguous float tensor the kernel can load. The interpreter mishandles bfloat16 (numpy
    has no such type), so there floats go in as float32; compiled kernels convert after the load,
    which gives the same float32 values."""
    if INTERPRETED and t.dtype not in (torch.float32, torch.float64):
        t = t.float()
    return t.contiguous()


def _block_v(vocab: int, cap: int | None = None) -> int:
    cap = MAX_BLOCK_V if cap is None else cap
    return max(16, min(triton.next_power_of_2(max(vocab, 1)), cap))


# ----------------------------------------------------------------------------------------------
# kernels

@triton.jit
def _chain_greedy_kernel(draft_ptr, cu_ptr, target_ptr, out_ptr, num_acc_ptr, out_cols,
                         BLOCK_K: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    start = tl.load(cu_ptr + b)
    num = tl.load(cu_ptr + b + 1) - start
    j = tl.arange(0, BLOCK_K)
    drafts = tl.load(draft_ptr + start + j, mask=j < num, other=-1)
    # request b's target rows start at cu[b] + b
    targets = tl.load(target_ptr + start + b + j, mask=j <= num, other=-1)
    mismatch = (j < num) & (drafts != targets)
    n_acc = tl.min(tl.where(mismatch, j, num), axis=0)
    vals = tl.where(j < n_acc, drafts, tl.where(j == n_acc, targets, -1))
    tl.store(out_ptr + b * out_cols + j, vals, mask=j < out_cols)
    tl.store(num_acc_ptr + b, n_acc)


@triton.jit
def _chain_sampling_kernel(draft_ptr, cu_ptr, p_ptr, q_ptr, u_ptr, e_ptr, out_ptr, num_acc_ptr,
                           vocab, out_cols, HAS_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_V: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    start = tl.load(cu_ptr + b)
    num = tl.load(cu_ptr + b + 1) - start
    j = tl.arange(0, BLOCK_K)
    jm = j < num
    drafts = tl.load(draft_ptr + start + j, mask=jm, other=0)
    p_tok = tl.load(p_ptr + (start + b + j) * vocab + drafts, mask=jm, other=0.0).to(tl.float32)
    if HAS_Q:
        q_tok = tl.load(q_ptr + (start + j) * vocab + drafts, mask=jm, other=1.0).to(tl.float32)
    else:
        q_tok = tl.full([BLOCK_K], 1.0, tl.float32)
    u = tl.load(u_ptr + start + j, mask=jm, other=2.0).to(tl.float64)
    # q(x) == 0: x cannot have been drafted from q; reject instead of dividing by zero
    q_safe = tl.where(q_tok > 0, q_tok, 1.0).to(tl.float64)
    accept = jm & (q_tok > 0) & (u <= p_tok.to(tl.float64) / q_safe)
    n_acc = tl.min(tl.where(jm & (accept == 0), j, num), axis=0)

    # emitted token: sample of max(p - q, 0) at the first rejection, of p at the bonus row
    rejected = n_acc < num
    row = start + b + n_acc
    rej_tok = tl.load(draft_ptr + start + n_acc, mask=rejected, other=-1)
    q_len = tl.where(rejected, vocab, 0)  # no q row (q = 0) for the bonus
    best_val = tl.full([], -1.0, tl.float32)  # scores are >= 0
    best_idx = tl.full([], 0, tl.int64)
    for v0 in range(0, vocab, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        vm = offs < vocab
        p = tl.load(p_ptr + row * vocab + offs, mask=vm, other=0.0).to(tl.float32)
        if HAS_Q:
            q = tl.load(q_ptr + (start + n_acc) * vocab + offs, mask=offs < q_len,
                        other=0.0).to(tl.float32)
        else:
            q = tl.where(offs == rej_tok, 1.0, 0.0)
        e = tl.load(e_ptr + row * vocab + offs, mask=vm, other=1.0).to(tl.float32)
        score = tl.where(vm, tl.math.div_rn(tl.maximum(p - q, 0.0), e), -1.0)
        blk_val, blk_idx = tl.max(score, axis=0, return_indices=True)
        better = blk_val > best_val  # strict: an earlier block wins ties
        best_idx = tl.where(better, v0 + blk_idx, best_idx)
        best_val = tl.where(better, blk_val, best_val)
    vals = tl.where(j < n_acc, drafts, tl.where(j == n_acc, best_idx, -1))
    tl.store(out_ptr + b * out_cols + j, vals, mask=j < out_cols)
    tl.store(num_acc_ptr + b, n_acc)


# Trees: one pass over nodes in index order. A node is tried iff its parent is the current node;
# children follow their parent, so this tries every child of each visited node in index order.

@triton.jit
def _tree_greedy_kernel(tok_ptr, par_ptr, target_ptr, path_ptr, out_ptr, num_acc_ptr, n_nodes,
                        out_cols):
    b = tl.program_id(0).to(tl.int64)
    base = b * n_nodes
    cur = tl.full([], 0, tl.int64)
    depth = tl.full([], 0, tl.int64)
    cur_target = tl.load(target_ptr + base)
    for c in range(1, n_nodes):
        parent = tl.load(par_ptr + base + c)
        tok = tl.load(tok_ptr + base + c)
        accept = (parent == cur) & (tok == cur_target)
        depth = tl.where(accept, depth + 1, depth)
        cur = tl.where(accept, c, cur)
        tl.store(path_ptr + b * out_cols + depth, cur, mask=accept)
        tl.store(out_ptr + b * out_cols + depth - 1, tok, mask=accept)
        cur_target = tl.load(target_ptr + base + cur)
    tl.store(path_ptr + b * out_cols, tl.full([], 0, tl.int64))
    tl.store(out_ptr + b * out_cols + depth, cur_target)
    tl.store(num_acc_ptr + b, depth)


@triton.jit
def _tree_sampling_kernel(tok_ptr, par_ptr, p_ptr, u_ptr, e_ptr, path_ptr, out_ptr, num_acc_ptr,
                          n_nodes, vocab, out_cols, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    base = b * n_nodes
    cur = tl.full([], 0, tl.int64)
    depth = tl.full([], 0, tl.int64)
    # float64 mass of the residual at cur: sum(p[cur]) minus each rejected sibling's p
    acc = tl.zeros([BLOCK_V], tl.float64)
    for v0 in range(0, vocab, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        acc += tl.load(p_ptr + base * vocab + offs, mask=offs < vocab,
                       other=0.0).to(tl.float32).to(tl.float64)
    total = tl.sum(acc, axis=0)
    for c in range(1, n_nodes):
        parent = tl.load(par_ptr + base + c)
        tok = tl.load(tok_ptr + base + c)
        child = parent == cur
        p_tok = tl.load(p_ptr + (base + cur) * vocab + tok, mask=child,
                        other=0.0).to(tl.float32).to(tl.float64)
        u = tl.load(u_ptr + base + c, mask=child, other=2.0).to(tl.float64)
        accept = child & (u <= p_tok / total)
        total = tl.where(child & (accept == 0), total - p_tok, total)
        depth = tl.where(accept, depth + 1, depth)
        cur = tl.where(accept, c, cur)
        tl.store(path_ptr + b * out_cols + depth, cur, mask=accept)
        tl.store(out_ptr + b * out_cols + depth - 1, tok, mask=accept)
        if accept:
            acc = tl.zeros([BLOCK_V], tl.float64)
            for v0 in range(0, vocab, BLOCK_V):
                offs = v0 + tl.arange(0, BLOCK_V)
                acc += tl.load(p_ptr + (base + cur) * vocab + offs, mask=offs < vocab,
                               other=0.0).to(tl.float32).to(tl.float64)
            total = tl.sum(acc, axis=0)

    # leaf: r = p (bonus); otherwise every child of cur was rejected: r = p without their tokens
    n_idx = tl.arange(0, BLOCK_N)
    nm = (n_idx > 0) & (n_idx < n_nodes)
    parents = tl.load(par_ptr + base + n_idx, mask=nm, other=-1)
    toks = tl.load(tok_ptr + base + n_idx, mask=nm, other=-1)
    child_toks = tl.where(parents == cur, toks, -1)
    row = base + cur
    best_val = tl.full([], -1.0, tl.float32)  # scores are >= 0
    best_idx = tl.full([], 0, tl.int64)
    for v0 in range(0, vocab, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        vm = offs < vocab
        p = tl.load(p_ptr + row * vocab + offs, mask=vm, other=0.0).to(tl.float32)
        e = tl.load(e_ptr + row * vocab + offs, mask=vm, other=1.0).to(tl.float32)
        removed = tl.max((offs[:, None] == child_toks[None, :]).to(tl.int32), axis=1) > 0
        score = tl.where(vm, tl.math.div_rn(tl.where(removed, 0.0, p), e), -1.0)
        blk_val, blk_idx = tl.max(score, axis=0, return_indices=True)
        better = blk_val > best_val  # strict: an earlier block wins ties
        best_idx = tl.where(better, v0 + blk_idx, best_idx)
        best_val = tl.where(better, blk_val, best_val)
    tl.store(path_ptr + b * out_cols, tl.full([], 0, tl.int64))
    tl.store(out_ptr + b * out_cols + depth, best_idx)
    tl.store(num_acc_ptr + b, depth)


# True when this process runs the kernels in Triton's CPU interpreter (TRITON_INTERPRET=1 was set
# before triton was imported); a compiled-mode tl library means CPU tensors cannot be used.
INTERPRETED = not isinstance(_chain_greedy_kernel, JITFunction) \
    and not isinstance(tl.max, JITFunction)


# ----------------------------------------------------------------------------------------------
# launchers (same signatures as the reference functions)

def chain_verify_greedy(draft_ids, cu_num_draft, target_argmax, kmax: int):
    batch = cu_num_draft.shape[0] - 1
    device = draft_ids.device
    out = torch.empty((batch, kmax + 1), dtype=torch.long, device=device)
    num_accepted = torch.empty(batch, dtype=torch.long, device=device)
    if batch:
        _chain_greedy_kernel[(batch,)](
            draft_ids.contiguous(), cu_num_draft.contiguous(), target_argmax.contiguous(), out,
            num_accepted, kmax + 1, BLOCK_K=triton.next_power_of_2(kmax + 1))
    return out, num_accepted


def chain_verify_sampling(draft_ids, cu_num_draft, target_probs, draft_probs, uniforms, exp_noise,
                          kmax: int):
    batch = cu_num_draft.shape[0] - 1
    vocab = target_probs.shape[1]
    device = draft_ids.device
    out = torch.empty((batch, kmax + 1), dtype=torch.long, device=device)
    num_accepted = torch.empty(batch, dtype=torch.long, device=device)
    if batch:
        p = _float_input(target_probs)
        q = p if draft_probs is None else _float_input(draft_probs)  # p: unused placeholder
        _chain_sampling_kernel[(batch,)](
            draft_ids.contiguous(), cu_num_draft.contiguous(), p, q,
            uniforms.double().contiguous(), _float_input(exp_noise), out, num_accepted,
            vocab, kmax + 1, HAS_Q=draft_probs is not None,
            BLOCK_K=triton.next_power_of_2(kmax + 1), BLOCK_V=_block_v(vocab))
    return out, num_accepted


def _tree_outputs(tree_tokens, max_depth: int):
    batch = tree_tokens.shape[0]
    device = tree_tokens.device
    path = torch.full((batch, max_depth + 1), -1, dtype=torch.long, device=device)
    out = torch.full((batch, max_depth + 1), -1, dtype=torch.long, device=device)
    return path, out, torch.empty(batch, dtype=torch.long, device=device)


def tree_verify_greedy(tree_tokens, parents, target_argmax, max_depth: int):
    batch, n = tree_tokens.shape
    path, out, num_accepted = _tree_outputs(tree_tokens, max_depth)
    if batch:
        _tree_greedy_kernel[(batch,)](
            tree_tokens.contiguous(), parents.contiguous(), target_argmax.contiguous(), path, out,
            num_accepted, n, max_depth + 1)
    return path, out, num_accepted


def tree_verify_sampling(tree_tokens, parents, target_probs, uniforms, exp_noise, max_depth: int):
    batch, n, vocab = target_probs.shape
    path, out, num_accepted = _tree_outputs(tree_tokens, max_depth)
    if batch:
        block_n = triton.next_power_of_2(n)
        _tree_sampling_kernel[(batch,)](
            tree_tokens.contiguous(), parents.contiguous(), _float_input(target_probs),
            uniforms.double().contiguous(), _float_input(exp_noise), path, out, num_accepted,
            n, vocab, max_depth + 1, BLOCK_N=block_n,
            BLOCK_V=_block_v(vocab, min(MAX_BLOCK_V, max(16, _TREE_TILE // block_n))))
    return path, out, num_accepted
