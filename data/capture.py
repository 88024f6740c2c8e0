"""Online capture: the target's hidden states for one batch, in memory.

Layer indices follow :mod:`draftlab.models.target` (``hidden[0]`` = embeddings, ``hidden[L]``
= last layer after the final norm). ``hidden[L]`` is always captured: target logits are
``lm_head(hidden[L])``, recomputed where needed instead of being kept (49k floats a token for
the default target against 576 per layer). Offline shards (:mod:`draftlab.data.offline`) hold
the same states per sample; :mod:`draftlab.data.features` feeds either to the trainer.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch

from draftlab.errors import DraftlabError


def resolve_layers(layers: str | Sequence[int], num_layers: int) -> list[int]:
    """Hidden-state indices to capture, ascending, always including ``num_layers`` (L).

    ``layers`` is a drafter family name (its ``default_capture_layers``: ``"eagle3"`` ->
    [2, L//2, L-3, L]), comma-separated indices ``"2,15,27"`` or a list of indices."""
    L = num_layers
    if isinstance(layers, str):
        text = layers.strip().lower()
        try:
            chosen = [int(p) for p in text.split(",") if p.strip()]
        except ValueError:
            if "," in text:
                raise DraftlabError(f"layers: expected a drafter family or comma-separated layer indices, got '{layers}'") from None
            from draftlab.models.drafter import DRAFTERS

            chosen = DRAFTERS.get(text, "layers").default_capture_layers(L)
        if not chosen:
            raise DraftlabError(f"layers: no layer index in '{layers}'")
    else:
        chosen = list(layers)
        for i in chosen:
            if isinstance(i, bool) or not isinstance(i, int):
                raise DraftlabError(f"layers: indices must be integers, got {i!r}")
    for i in chosen:
        if not 0 <= i <= L:
            raise DraftlabError(f"layers: index {i} is out of range 0..{L} for a {L}-layer target")
    return sorted(set(chosen) | {L})


def _right_padded(mask: torch.Tensor) -> bool:
    """True when every row is ones then zeros (what ``collate`` produces)."""
    return bool((mask[:, 1:] <= mask[:, :-1]).all())


def _padding_kwargs(attention_mask: torch.Tensor | None, device) -> dict:
    """``Target.forward`` arguments that make padded rows compute their unpadded states."""
    if attention_mask is None:
        return {}
    mask = attention_mask.to(device=device, dtype=torch.bool)
    # Right padding needs no mask: under causal attention a real token never sees a later
    # pad, and positions 0.. are those of the unpadded sample, so SDPA keeps its fast
    # is_causal kernel. Any other padding gets explicit positions and a key mask.
    if _right_padded(mask):
        return {}
    T = mask.shape[1]
    eye = torch.eye(T, dtype=torch.bool, device=mask.device)
    attn = torch.ones(T, T, dtype=torch.bool, device=mask.device).tril()[None] & mask[:, None, :]
    # a pad query may see itself: a row with nothing to attend to would give NaN, and NaN
    # values leak into real tokens through 0-weighted attention later on
    return {"attn_mask": attn | eye, "position_ids": (mask.long().cumsum(-1) - 1).clamp(min=0)}


@torch.no_grad()
def capture_batch(
    target,
    input_ids: torch.Tensor,
    layers: str | Sequence[int],
    attention_mask: torch.Tensor | None = None,
    compile: bool = False,
) -> dict[int, torch.Tensor]:
    """One target forward over a batch [B, T]; no disk. Returns ``{layer: Float[B, T, H]}``.

    ``layers``: see :func:`resolve_layers` (L is always included). With ``attention_mask``
    (1 = real token, any padding side) real tokens get the states of the unpadded sample
    (equal up to the fp32 rounding of a different batch shape); values at padded positions
    are unspecified. ``compile``: see :func:`compiled_forward`. Runs under ``no_grad``, not
    ``inference_mode``: inference tensors could not be saved for the drafter's backward."""
    layer_ids = resolve_layers(layers, target.num_layers)
    forward = compiled_forward(target) if compile else target
    kwargs = _padding_kwargs(attention_mask, input_ids.device)
    return forward(input_ids, layers=layer_ids, logits=None, **kwargs).hidden


_COMPILED_FORWARD = None  # torch.compile(Target.forward), built on first use


def compiled_forward(target) -> Callable:
    """``target.forward`` through ``torch.compile`` (inductor, dynamic shapes, so one graph
    serves every batch shape; sizes 1 get their own). On CPU it fuses the norms, RoPE and
    activations into a few kernels: fewer passes over memory and far fewer thread-pool
    barriers, which matters most on a busy machine (bench/capture.py). Inside the graph every
    product is a plain linear (``Target._linear``: inductor cannot lower the packed small-row
    GEMM). Compiling unrolls every layer into one graph, which takes minutes (many on a small
    CPU) once per process; numerics differ from eager at fp32 rounding level, so a capture is
    resumed with the same setting."""
    global _COMPILED_FORWARD
    if _COMPILED_FORWARD is None:
        from draftlab.models.target import Target

        # the unbound method: holding no target keeps targets collectable
        _COMPILED_FORWARD = torch.compile(Target.forward, dynamic=True)
    return functools.partial(_COMPILED_FORWARD, target)
