"""The prefill: each prompt's forward into its row of the KV cache, and a cache of whole prompts'
prefills for the next decoding of the same prompt (an evaluation decodes every prompt once per
configuration and batch size, and the prefill is the same forward each time)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class Prefilled:
    """One prompt's prefill: its K/V [L, H_kv, T, D], the logits at its last position and the
    hidden states of the layers asked ({layer: [1, T, H]})."""

    k: torch.Tensor
    v: torch.Tensor
    logits: torch.Tensor
    hidden: dict[int, torch.Tensor]

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.logits, *self.hidden.values()))


class PromptCache:
    """Prefills of whole prompts by one target (a prefix cache at prompt granularity), least
    recently used out first beyond ``max_bytes``. A copy gives the decoder the K/V, logits and
    hidden states the forward would."""

    def __init__(self, target, max_bytes: int = 2 << 30):
        self.target, self.max_bytes = base_model(target), max_bytes
        self._kept: OrderedDict[tuple[int, ...], Prefilled] = OrderedDict()
        self.bytes = self.hits = self.misses = 0

    def get(self, prompt: torch.Tensor, layers) -> Prefilled | None:
        """The prompt's prefill if kept with every layer in ``layers``; None counts a miss."""
        key = tuple(prompt.tolist())
        done = self._kept.get(key)
        if done is None or not set(layers) <= done.hidden.keys():
            self.misses += 1
            return None
        self._kept.move_to_end(key)
        self.hits += 1
        return done

    def put(self, prompt: torch.Tensor, done: Prefilled) -> None:
        key = tuple(prompt.tolist())
        if key in self._kept:
            self.bytes -= self._kept.pop(key).bytes
        if done.bytes > self.max_bytes:
            return
        self._kept[key] = done
        self.bytes += done.bytes
        while self.bytes > self.max_bytes:
            self.bytes -= self._kept.popitem(last=False)[1].bytes


def base_model(target):
    """The model under a ``GraphedTarget`` (or ``target`` itself): what owns the prompt cache's
    prefills and the device loop's caches, whichever loop runs through the wrapper."""
    return getattr(target, "target", target)


def prefill(target, prompts, slots, layers, cache, forward, prompt_cache: PromptCache | None = None):
    """Each prompt in its own forward (``forward(target, ...)``, a timed call), into its row
    ``slots[r]`` of ``cache``, or copied from ``prompt_cache`` when it holds that prompt. One
    forward per prompt: padding a 33- and a 2,544-token prompt to one forward would compute the
    short one's padding. Returns the logits at each prompt's last position [B, V] and each
    prompt's hidden states ({layer: [1, T_r, H]})."""
    if prompt_cache is not None and prompt_cache.target is not base_model(target):
        raise ValueError("prompt_cache: it holds another target's prefills")
    last, hidden = [], []
    for p, s in zip(prompts, slots):
        n = p.numel()
        done = kept = prompt_cache.get(p, layers) if prompt_cache is not None else None
        if done is None and hasattr(target, "prefill_prompt"):  # a GraphedTarget: replayed in its own buffer
            done = forward(target.prefill_prompt, p, layers)
        if done is None:
            out = forward(target, p[None], layers=list(layers), cache=cache.row(s), logits="last")
            done = Prefilled(cache.k[:, s, :, :n].clone(), cache.v[:, s, :, :n].clone(), out.logits[0, -1], out.hidden)
        else:
            cache.k[:, s, :, :n] = done.k
            cache.v[:, s, :, :n] = done.v
        if kept is None and prompt_cache is not None:
            prompt_cache.put(p, done)
        cache.lengths[s] = n  # what the row view filled or the copy wrote
        last.append(done.logits)
        hidden.append({i: done.hidden[i] for i in layers})
    return torch.stack(last), hidden
