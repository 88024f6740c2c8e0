"""Proposer for EAGLE-1 and EAGLE-3 drafters: chain drafting and the EAGLE-2 dynamic tree.

The drafter keeps its own KV cache of *committed* positions, built from the target's real
features. Drafting appends speculative positions (fed the drafter's own output features) and
crops them away afterwards; ``advance`` then re-runs the accepted tokens with the target's
real features, as EAGLE does.
"""

from __future__ import annotations

import torch

from draftlab.inference.proposer import ChainDraft, DraftTree, Proposer, TreeSpec
from draftlab.models.cpu_gemm import decoding_copy


class EagleProposer(Proposer):
    supports_tree = True

    def __init__(self, drafter, min_confidence: float = 0.0):
        if not 0.0 <= min_confidence < 1.0:
            raise ValueError(f"min_confidence must be in [0, 1), got {min_confidence}")
        # A frozen copy whose linears run the few-row products of decoding on the CPU's faster GEMM
        # (models/cpu_gemm.py; on the AMD EPYC a 2-token drafter step went from 8.9 to 4.1 ms).
        self.d = decoding_copy(drafter.eval())
        self.name = drafter.algorithm
        self.layers = tuple(drafter.capture_layers)
        # Dynamic draft length: a chain stops before the draft at which the product of the
        # drafter's top-1 probabilities drops below this (0 = always k). A low-confidence step
        # then costs a 1-token target forward instead of a (k+1)-token verify that would
        # likely accept nothing, which pays where verifying is much dearer than one token.
        self.min_confidence = min_confidence

    # ---- committed state ---------------------------------------------------------
    @torch.no_grad()
    def start(self, prompt_ids, hidden, next_token):
        self.cache = self.d.new_cache()
        self.pos = 0
        prompt_ids = prompt_ids.view(1, -1)
        nxt = torch.tensor([[next_token]], device=prompt_ids.device)
        # position t pairs token x_{t+1} with the target feature f_t
        self._extend(torch.cat([prompt_ids[:, 1:], nxt], dim=1), hidden)

    @torch.no_grad()
    def advance(self, accepted, hidden):
        self._extend(accepted.view(1, -1), hidden)

    def _extend(self, tokens, hidden):
        n = tokens.shape[1]
        positions = torch.arange(self.pos, self.pos + n, device=tokens.device)[None]
        h, logits = self.d.draft_step(tokens, self.d.features(hidden), positions, self.cache)
        self.pos += n
        self.last_h, self.last_logits = h[:, -1:], logits[0, -1]

    # ---- chain -------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, k: int) -> ChainDraft:
        committed = self.cache.length
        h, logits = self.last_h, self.last_logits
        out = []
        confidence = 1.0
        for j in range(k):
            top = logits.max(-1, keepdim=True)
            if self.min_confidence > 0:  # top-1 probability = exp(max logit - logsumexp)
                confidence *= float((top.values.float() - logits.float().logsumexp(-1)).exp())
                if confidence < self.min_confidence:
                    break
            tok = self.d.to_target_ids(top.indices)
            out.append(tok)
            if j + 1 < k:
                pos = torch.full((1, 1), self.pos + j, device=tok.device)
                h, lg = self.d.draft_step(tok.view(1, 1), h, pos, self.cache)
                logits = lg[0, -1]
        self.cache.crop(committed)
        tokens = torch.cat(out) if out else torch.zeros(0, dtype=torch.long, device=logits.device)
        return ChainDraft(tokens, None)  # greedy drafts = point-mass proposals

    # ---- EAGLE-2 dynamic tree --------------------------------------------------------------
    @torch.no_grad()
    def propose_tree(self, spec: TreeSpec) -> DraftTree:
        """Top-k at the root; each later depth expands the k best frontier nodes (by cumulative
        log-prob) into k children each; all candidates are pooled and the ``total_tokens`` best
        are kept (their ancestors always score at least as high, so the tree stays closed)."""
        committed = self.cache.length
        dev = self.last_h.device
        k = spec.top_k
        lp = self.last_logits.float().log_softmax(-1)
        score, ids = lp.topk(min(k, lp.numel()))
        # pool of candidate nodes (draft vocab ids), parent = pool index or -1 for the root
        tok, parent, depth, scores = ids.tolist(), [-1] * len(ids), [1] * len(ids), score.tolist()
        frontier = list(range(len(ids)))
        feats = self.last_h.expand(1, len(frontier), -1)
        slot: dict[int, int] = {}  # pool index -> drafter cache slot of its expanded position
        for d in range(1, spec.depth):
            n = len(frontier)
            base = self.cache.length
            mask = torch.zeros(1, n, base + n, dtype=torch.bool, device=dev)
            mask[0, :, :committed] = True
            for r, i in enumerate(frontier):
                a = parent[i]
                while a >= 0:  # ancestors' speculative positions
                    mask[0, r, slot[a]] = True
                    a = parent[a]
                mask[0, r, base + r] = True
                slot[i] = base + r
            toks = self.d.to_target_ids(torch.tensor([[tok[i] for i in frontier]], device=dev))
            pos = torch.full((1, n), self.pos + d - 1, device=dev)
            h, logits = self.d.draft_step(toks, feats, pos, self.cache, mask)
            clp, cid = logits[0].float().log_softmax(-1).topk(k, dim=-1)  # [n, k]
            cum = torch.tensor([scores[i] for i in frontier], device=dev)[:, None] + clp
            first = len(tok)
            for r, i in enumerate(frontier):
                tok += cid[r].tolist()
                parent += [i] * k
                depth += [d + 1] * k
                scores += cum[r].tolist()
            best = cum.flatten().topk(min(k, cum.numel())).indices
            frontier = [first + int(b) for b in best]
            feats = h[:, best // k]
        self.cache.crop(committed)

        # Best-first by cumulative log-prob (ties: shallower first, so a parent always comes
        # before its children); a node joins only after its parent, keeping the tree closed.
        kept: set[int] = set()
        for i in sorted(range(len(tok)), key=lambda i: (-scores[i], depth[i])):
            if len(kept) == spec.total_tokens:
                break
            if parent[i] < 0 or parent[i] in kept:
                kept.add(i)
        order = sorted(kept, key=lambda i: (depth[i], -scores[i]))
        node_of = {i: n + 1 for n, i in enumerate(order)}  # node 0 is the root
        tokens = self.d.to_target_ids(torch.tensor([tok[i] for i in order], device=dev))
        parents = torch.tensor([node_of.get(parent[i], 0) for i in order], device=dev)
        depths = torch.tensor([depth[i] for i in order], device=dev)
        return DraftTree(tokens, parents, depths)
