"""Verify kernels of draftlab's speculative decoder: the single dispatch point.

Four verifiers, each with a plain PyTorch reference (:mod:`draftlab.kernels.reference`) and a
Triton kernel (:mod:`draftlab.kernels.triton_verify`). Every function takes
``backend="auto" | "triton" | "torch"``: "auto" runs Triton when the tensors are on CUDA and the
torch reference otherwise (on CPU it never imports Triton; on CUDA without a working Triton it
warns once and uses the reference); "triton" forces Triton (on CPU only in Triton's interpreter:
``TRITON_INTERPRET=1`` set before triton is first imported); "torch" forces the reference.
Outputs are on the inputs' device; token outputs are int64 and padded with -1. Inputs are
validated here (shapes, dtypes, devices, value ranges); bad input raises
:class:`~draftlab.errors.DraftlabError` naming the argument. Validation and the output width
need a few values on the host: one device sync per call.

Chain layout (vLLM v1 style, ragged batch of B requests, N drafts in total)
---------------------------------------------------------------------------
- ``draft_ids: Long[N]``: request b's K_b = cu[b+1] - cu[b] drafts (K_b may be 0) sit at flat
  positions cu[b] .. cu[b+1]-1.
- ``cu_num_draft: Long[B+1]``: cu[0] = 0, non-decreasing, cu[B] = N.
- target rows (``target_argmax: Long[N+B]``, ``target_probs: Float[N+B, V]``,
  ``exp_noise: Float[N+B, V]``): K_b + 1 rows per request, at cu[b] + b .. cu[b+1] + b; row
  cu[b] + b + j is the target's prediction for draft position j, the last row is the bonus
  position.
- draft rows (``draft_probs: Float[N, V] | None``, ``uniforms: Float64[N]``): one per draft,
  same flat positions as ``draft_ids``. ``draft_probs=None`` means point-mass proposals.
- returns ``out: Long[B, Kmax+1]`` (accepted drafts, then the correction or bonus token, then
  -1; Kmax = max K_b, 0 when N == 0) and ``num_accepted: Long[B]``.

Greedy: accept while draft == target argmax. Sampling: accept x_j iff q_j(x_j) > 0 and
u_j <= p_j(x_j) / q_j(x_j) (ratio in float64; q(x) = 0 is rejected, as in vLLM, since such a
draft cannot come from q). At the first rejection emit argmax_v(max(p_j - q_j, 0)[v] / E_j[v])
with E = exp_noise ~ Exp(1), a sample of norm(max(0, p - q)); if all K_b are accepted emit the
bonus argmax_v(p[v] / E[v]) from the bonus row.

Tree layout (B trees padded to N nodes)
---------------------------------------
- ``tree_tokens: Long[B, N]``, ``parents: Long[B, N]``: node 0 is the root (the last verified
  token, parents[b, 0] = -1; its token is not read); a draft node's parent has a smaller index.
  Padding nodes have parent -1 and are ignored (so are nodes hanging below padding).
- ``target_argmax: Long[B, N]``, ``target_probs: Float[B, N, V]``, ``exp_noise: Float[B, N, V]``:
  the target's prediction for the position after node n. ``uniforms: Float64[B, N]``: the coin
  of node n (unused for the root).
- returns ``path: Long[B, D+1]`` (accepted node indices, starting with the root 0),
  ``out: Long[B, D+1]`` (accepted draft tokens, then the correction or bonus token) both padded
  with -1, and ``num_accepted: Long[B]``; D = max depth of any tree in the batch.

Greedy: from the root, move to the first child (in index order) whose token equals the target
argmax of the current node; stop when none matches; emit target_argmax of the last node.
Sampling (SGLang's target-only tree sampling, point-mass proposals): at node u with residual
r = target_probs[b, u], try the children in index order, accepting child c iff
uniforms[b, c] <= r[tok_c] / sum(r) (float64) and otherwise setting r[tok_c] = 0. If a child is
accepted move to it; if none is, emit argmax(r / exp_noise[b, u]) as the correction; at a leaf
emit argmax(target_probs[b, u] / exp_noise[b, u]) as the bonus. Siblings must carry distinct
tokens (the drafter proposes distinct candidates per position); this is checked.

The decoder's accept rule
-------------------------
:func:`accept_chains` and :func:`accept_trees` verify a batch's step (one sequence is the batch
of one) from the target's logits: they choose greedy or sampling, draw the verifier's coins and
Exp(1) noise from ``sampling.generator`` and call the verifiers above.
"""

from __future__ import annotations

import itertools
import os
import warnings

import torch

from draftlab.device import device_ints
from draftlab.errors import DraftlabError
from draftlab.kernels import reference

__all__ = [
    "accept_chains",
    "accept_fixed_chains",
    "accept_fixed_trees",
    "accept_trees",
    "chain_verify_greedy",
    "chain_verify_sampling",
    "tree_verify_greedy",
    "tree_verify_sampling",
]

BACKENDS = ("auto", "triton", "torch")
_warned_fallback = False


def _load_triton():
    """Import the Triton kernels module, or raise DraftlabError saying why it is unusable."""
    try:
        from draftlab.kernels import triton_verify
    except Exception as exc:  # ImportError, or a broken Triton install failing at import
        raise DraftlabError(f"backend='triton': Triton is unavailable "
                            f"({type(exc).__name__}: {exc})") from exc
    return triton_verify


def _backend(backend: str, device: torch.device):
    """The module (reference or triton_verify) that runs this call."""
    global _warned_fallback
    if backend not in BACKENDS:
        raise DraftlabError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return reference
    if device.type != "cuda":
        # forced Triton on CPU: only Triton's interpreter can run it
        # (checked before importing triton, which would fix its mode for this process)
        if os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes"):
            raise DraftlabError(f"backend='triton': tensors are on {device}; Triton needs CUDA "
                                "tensors or TRITON_INTERPRET=1")
        module = _load_triton()
        if not module.INTERPRETED:
            raise DraftlabError("backend='triton' on CPU: TRITON_INTERPRET=1 must be set before "
                                "triton is first imported")
        return module
    if backend == "triton":
        return _load_triton()
    try:
        return _load_triton()
    except DraftlabError as exc:
        if not _warned_fallback:
            warnings.warn(f"{exc}; falling back to the torch reference verifiers", stacklevel=3)
            _warned_fallback = True
        return reference


def _ints(name: str, t, ndim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype.is_complex \
            or t.dtype == torch.bool:
        got = getattr(t, "dtype", type(t))
        raise DraftlabError(f"{name}: expected an integer tensor, got {got}")
    if t.dim() != ndim:
        raise DraftlabError(f"{name}: expected {ndim} dimension(s), got shape {tuple(t.shape)}")
    return t.long()


def _floats(name: str, t, shape: tuple) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
        got = getattr(t, "dtype", type(t))
        raise DraftlabError(f"{name}: expected a floating-point tensor, got {got}")
    if tuple(t.shape) != tuple(shape):
        raise DraftlabError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    return t


def _same_device(**tensors) -> torch.device:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    first = next(iter(devices.values()))
    for name, dev in devices.items():
        if dev != first:
            raise DraftlabError(f"{name}: on {dev}, other inputs are on {first}")
    return first


def _chain_layout(draft_ids: torch.Tensor, cu: torch.Tensor, vocab: int | None) -> int:
    """Validate the ragged layout (and draft ids < vocab when given); return Kmax."""
    if cu.shape[0] < 1:
        raise DraftlabError("cu_num_draft: needs B+1 >= 1 entries")
    n = draft_ids.shape[0]
    lengths = cu[1:] - cu[:-1]
    zero = cu.new_zeros(())
    checks = [cu[0], cu[-1],
              lengths.min() if lengths.numel() else zero,
              lengths.max() if lengths.numel() else zero]
    if vocab is not None:
        checks += [draft_ids.min() if n else zero, draft_ids.max() if n else zero]
    first, last, shortest, kmax, *ids = torch.stack(checks).tolist()  # the one host sync
    if first != 0 or last != n or shortest < 0:
        raise DraftlabError(f"cu_num_draft: must start at 0, be non-decreasing and end at "
                            f"len(draft_ids)={n}; got start {first}, end {last}")
    if ids and (ids[0] < 0 or ids[1] >= vocab):
        raise DraftlabError(f"draft_ids: token ids must lie in [0, {vocab}); "
                            f"got [{ids[0]}, {ids[1]}]")
    return int(kmax)


def _tree_layout(tree_tokens: torch.Tensor, parents: torch.Tensor, vocab: int | None) -> int:
    """Validate the tree batch; return D, the max depth of a node reachable from a root.

    Depths come from pointer jumping (log2 N gathers) rather than a loop over nodes."""
    if tree_tokens.shape != parents.shape:
        raise DraftlabError(f"parents: shape {tuple(parents.shape)} differs from tree_tokens "
                            f"{tuple(tree_tokens.shape)}")
    batch, n = parents.shape
    if n < 1:
        raise DraftlabError("tree_tokens: every tree needs a root node (N >= 1)")
    if batch == 0:
        return 0
    idx = torch.arange(n, device=parents.device).expand(batch, n)
    bad_parent = (parents[:, 0] != -1).any() | ((parents < -1) | (parents >= idx))[:, 1:].any()
    has_parent = (parents >= 0) & (parents < idx)
    up = torch.where(has_parent, parents, idx)  # root and padding point at themselves
    dist = has_parent.long()
    for _ in range(max(n - 1, 1).bit_length()):
        dist = dist + dist.gather(1, up)
        up = up.gather(1, up)
    reachable = up == 0
    checks = [bad_parent, torch.where(reachable, dist, 0).amax()]
    if vocab is not None:
        draft = reachable & (idx > 0)
        checks.append((draft & ((tree_tokens < 0) | (tree_tokens >= vocab))).any())
        same = (parents[:, :, None] == parents[:, None, :]) \
            & (tree_tokens[:, :, None] == tree_tokens[:, None, :])
        pairs = draft[:, :, None] & draft[:, None, :] & ~torch.eye(n, dtype=torch.bool,
                                                                   device=parents.device)
        checks.append((same & pairs).any())
    bad_parent, max_depth, *tok_checks = torch.stack([c.long() for c in checks]).tolist()
    if bad_parent:
        raise DraftlabError("parents: parents[b, 0] must be -1 and parents[b, n] in [-1, n) "
                            "for n >= 1")
    if tok_checks and tok_checks[0]:
        raise DraftlabError(f"tree_tokens: draft token ids must lie in [0, {vocab})")
    if tok_checks and tok_checks[1]:
        raise DraftlabError("tree_tokens: siblings must carry distinct tokens")
    return int(max_depth)


def chain_verify_greedy(draft_ids, cu_num_draft, target_argmax, backend: str = "auto"):
    """Greedy chain verification; see the module docstring for the layout.
    Returns (out: Long[B, Kmax+1], num_accepted: Long[B])."""
    draft_ids = _ints("draft_ids", draft_ids, 1)
    cu = _ints("cu_num_draft", cu_num_draft, 1)
    target_argmax = _ints("target_argmax", target_argmax, 1)
    device = _same_device(draft_ids=draft_ids, cu_num_draft=cu, target_argmax=target_argmax)
    if target_argmax.shape[0] != draft_ids.shape[0] + cu.shape[0] - 1:
        raise DraftlabError(f"target_argmax: expected N+B = {draft_ids.shape[0] + cu.shape[0] - 1} "
                            f"rows, got {target_argmax.shape[0]}")
    kmax = _chain_layout(draft_ids, cu, None)
    return _backend(backend, device).chain_verify_greedy(draft_ids, cu, target_argmax, kmax)


def chain_verify_sampling(draft_ids, cu_num_draft, target_probs, draft_probs, uniforms, exp_noise,
                          backend: str = "auto"):
    """Lossless rejection-sampling chain verification; see the module docstring.
    Returns (out: Long[B, Kmax+1], num_accepted: Long[B])."""
    draft_ids = _ints("draft_ids", draft_ids, 1)
    cu = _ints("cu_num_draft", cu_num_draft, 1)
    n, batch = draft_ids.shape[0], cu.shape[0] - 1
    if not isinstance(target_probs, torch.Tensor) or target_probs.dim() != 2:
        raise DraftlabError("target_probs: expected a [N+B, V] tensor")
    vocab = target_probs.shape[1]
    _floats("target_probs", target_probs, (n + batch, vocab))
    if draft_probs is not None:
        _floats("draft_probs", draft_probs, (n, vocab))
    _floats("uniforms", uniforms, (n,))
    _floats("exp_noise", exp_noise, (n + batch, vocab))
    device = _same_device(draft_ids=draft_ids, cu_num_draft=cu, target_probs=target_probs,
                          draft_probs=draft_probs, uniforms=uniforms, exp_noise=exp_noise)
    kmax = _chain_layout(draft_ids, cu, vocab)
    return _backend(backend, device).chain_verify_sampling(
        draft_ids, cu, target_probs, draft_probs, uniforms.double(), exp_noise, kmax)


def tree_verify_greedy(tree_tokens, parents, target_argmax, backend: str = "auto"):
    """Greedy tree verification; see the module docstring.
    Returns (path: Long[B, D+1], out: Long[B, D+1], num_accepted: Long[B])."""
    tree_tokens = _ints("tree_tokens", tree_tokens, 2)
    parents = _ints("parents", parents, 2)
    target_argmax = _ints("target_argmax", target_argmax, 2)
    if target_argmax.shape != tree_tokens.shape:
        raise DraftlabError(f"target_argmax: expected shape {tuple(tree_tokens.shape)}, "
                            f"got {tuple(target_argmax.shape)}")
    device = _same_device(tree_tokens=tree_tokens, parents=parents, target_argmax=target_argmax)
    max_depth = _tree_layout(tree_tokens, parents, None)
    return _backend(backend, device).tree_verify_greedy(tree_tokens, parents, target_argmax,
                                                        max_depth)


def tree_verify_sampling(tree_tokens, parents, target_probs, uniforms, exp_noise,
                         backend: str = "auto"):
    """Lossless multi-candidate tree verification (point-mass proposals); see the module
    docstring. Returns (path: Long[B, D+1], out: Long[B, D+1], num_accepted: Long[B])."""
    tree_tokens = _ints("tree_tokens", tree_tokens, 2)
    parents = _ints("parents", parents, 2)
    if not isinstance(target_probs, torch.Tensor) or target_probs.dim() != 3:
        raise DraftlabError("target_probs: expected a [B, N, V] tensor")
    batch, n = tree_tokens.shape
    vocab = target_probs.shape[2]
    _floats("target_probs", target_probs, (batch, n, vocab))
    _floats("uniforms", uniforms, (batch, n))
    _floats("exp_noise", exp_noise, (batch, n, vocab))
    device = _same_device(tree_tokens=tree_tokens, parents=parents, target_probs=target_probs,
                          uniforms=uniforms, exp_noise=exp_noise)
    max_depth = _tree_layout(tree_tokens, parents, vocab)
    return _backend(backend, device).tree_verify_sampling(
        tree_tokens, parents, target_probs, uniforms.double(), exp_noise, max_depth)


# ---------------------------------------------------------------------- the decoder's accept rule
def accept_chains(drafts, target_logits, sampling, draft_probs=None, backend: str = "auto"):
    """Verify a batch of chains in one ragged call: ``drafts`` a list of Long[K_b] (K_b may be
    0), ``target_logits`` [B, T, V] with T > max K_b (row b's first K_b + 1 rows = the target
    after each input of ``[last token, drafts...]``; the rest is padding), ``sampling`` the
    generation's :class:`~draftlab.inference.sampling.Sampling`, ``draft_probs`` None or a list of
    Float[K_b, V] | None (None rows are point masses; read only when sampling).
    Returns (per row: emitted tokens = accepted drafts then the correction or bonus token;
    per row: number of drafts accepted)."""
    B, T, V = target_logits.shape
    dev = target_logits.device
    ks = [int(d.numel()) for d in drafts]
    flat = torch.cat([d.reshape(-1).long() for d in drafts]) if B else torch.zeros(0, dtype=torch.long, device=dev)
    # the layout is built here, valid by construction: host lists through pinned memory, no wait
    cu = device_ints([0, *itertools.accumulate(ks)], dev)
    rows = device_ints([b * T + j for b, k in enumerate(ks) for j in range(k + 1)], dev)
    logits = target_logits.reshape(B * T, V)[rows]  # [N + B, V]
    if sampling.greedy:
        kmax = max(ks, default=0)
        out, num = _backend(backend, dev).chain_verify_greedy(flat, cu, logits.max(-1).indices, kmax)
    else:
        gen = sampling.generator
        uniforms = torch.rand(flat.numel(), dtype=torch.float64, device=dev, generator=gen)
        noise = torch.empty(logits.shape, device=dev).exponential_(generator=gen)
        q = None
        if draft_probs is not None and any(p is not None for p in draft_probs):
            # a point mass is the one-hot distribution: rows without probabilities get it
            q = torch.cat([p.float() if p is not None else torch.nn.functional.one_hot(d.reshape(-1).long(), V).float()
                           for d, p in zip(drafts, draft_probs)])
        out, num = chain_verify_sampling(flat, cu, sampling.probs(logits), q, uniforms, noise, backend=backend)
    read = torch.cat([num[:, None], out], 1).tolist()  # the step's one read of the device
    return [row[1 : row[0] + 2] for row in read], [row[0] for row in read]



def accept_fixed_chains(drafts, target_logits, sampling, draft_probs=None, backend: str = "auto"):
    """Verify B chains of k drafts each with no host read (a captured step's accept):
    ``drafts`` Long[B, k], ``target_logits`` [B, k + 1, V] (the target after each input of
    ``[last, drafts...]``), ``draft_probs`` None (point masses) or [B, k, V]. Returns
    (``out`` Long[B, k + 1]: row b's first ``num[b]`` entries are its accepted drafts, the next
    its correction or bonus token; greedy fills the rest with the target's tokens, sampling
    with -1; ``num`` Long[B]). Unchecked: the caller builds the layout."""
    B, k = drafts.shape
    V = target_logits.shape[-1]
    if sampling.greedy:
        top = target_logits.max(-1).indices  # the host loop's tie rule
        return top, (drafts == top[:, :k]).long().cumprod(1).sum(1)
    dev, gen = target_logits.device, sampling.generator
    uniforms = torch.rand(B * k, dtype=torch.float64, device=dev, generator=gen)
    noise = torch.empty(B * (k + 1), V, device=dev).exponential_(generator=gen)
    cu = torch.arange(B + 1, device=dev) * k
    q = None if draft_probs is None else draft_probs.reshape(B * k, V).float()
    return _backend(backend, dev).chain_verify_sampling(drafts.reshape(-1), cu, sampling.probs(target_logits.reshape(-1, V)),
                                                       q, uniforms, noise, k)


def accept_fixed_trees(tokens, parents, target_logits, sampling, max_depth: int, backend: str = "auto"):
    """Verify B trees of N nodes each with no host read (a captured step's accept): the tree
    layout of :func:`accept_trees`, trees no deeper than ``max_depth``. Returns (path, out,
    num_accepted) as :func:`tree_verify_greedy` does, [B, max_depth + 1] padded with -1.
    Unchecked: the caller builds the layout."""
    B, N, V = target_logits.shape
    if sampling.greedy:
        return _backend(backend, tokens.device).tree_verify_greedy(tokens, parents, target_logits.max(-1).indices, max_depth)
    gen = sampling.generator
    uniforms = torch.rand(B, N, dtype=torch.float64, device=tokens.device, generator=gen)
    noise = torch.empty(B, N, V, device=tokens.device).exponential_(generator=gen)
    return _backend(backend, tokens.device).tree_verify_sampling(tokens, parents, sampling.probs(target_logits), uniforms, noise,
                                                                 max_depth)


def accept_trees(tokens, parents, target_logits, sampling, backend: str = "auto"):
    """Verify a batch of trees: ``tokens``, ``parents`` Long[B, N] (node 0 the root, parent -1;
    padding nodes have parent -1), ``target_logits`` [B, N, V] (row n = the target after node n).
    Returns (path: Long[B, D+1] accepted node indices from the root 0, padded with -1; per row:
    emitted tokens = accepted drafts then the correction or bonus token; per row: drafts accepted)."""
    B, N, V = target_logits.shape
    if sampling.greedy:
        path, out, num = tree_verify_greedy(tokens, parents, target_logits.max(-1).indices, backend=backend)
    else:
        gen = sampling.generator
        uniforms = torch.rand(B, N, dtype=torch.float64, device=tokens.device, generator=gen)
        noise = torch.empty(B, N, V, device=tokens.device).exponential_(generator=gen)
        path, out, num = tree_verify_sampling(tokens, parents, sampling.probs(target_logits), uniforms, noise,
                                              backend=backend)
    num, out = num.tolist(), out.tolist()
    return path, [row[: n + 1] for row, n in zip(out, num)], num
