"""Image embeddings into a step, as two model buffers the graphs read like weights.

A multimodal model carries ``mm_embeds`` [max_tokens, hidden] and ``mm_mask`` [max_tokens]; its
forward replaces the token embedding of every masked token by its row of ``mm_embeds`` (a masked
select inside the graph: no data-dependent shape, one graph per key as before). Before each step
the runner writes, for the step's tokens that sit at image placeholder positions, their rows of
the request's image embeddings and sets their mask; every other token's mask is cleared. Text-only
steps write nothing but the cleared mask, so a decode graph reads the same tokens it always did.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


def install(model: nn.Module, max_tokens: int, dtype: torch.dtype) -> "MultiModalBuffers":
    h = model.config.hidden_size
    model.register_buffer("mm_embeds", torch.zeros(max_tokens, h, dtype=dtype), persistent=False)
    model.register_buffer("mm_mask", torch.zeros(max_tokens, dtype=torch.bool), persistent=False)
    return MultiModalBuffers(model)


def merge(model: nn.Module, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x`` (the token embeddings) with the image embeddings at the masked tokens."""
    mask = getattr(model, "mm_mask", None)
    if mask is None:
        return x
    t = input_ids.shape[0]
    return torch.where(mask[:t, None], model.mm_embeds[:t].to(x.dtype), x)


class MultiModalBuffers:
    def __init__(self, model: nn.Module) -> None:
        self.embeds, self.mask = model.mm_embeds, model.mm_mask
        self.dirty = True

    def load(self, token_req: np.ndarray, positions: np.ndarray, req_ids, inputs_of) -> None:
        """``inputs_of(request id)``: its MultiModalInput or None."""
        if self.dirty:
            self.mask.zero_()
            self.dirty = False
        for r, rid in enumerate(req_ids):
            mm = inputs_of(rid)
            if mm is None:
                continue
            tokens = np.nonzero(token_req == r)[0]
            index = np.searchsorted(mm.positions, positions[tokens])
            index = np.minimum(index, len(mm.positions) - 1)
            hit = mm.positions[index] == positions[tokens]
            if hit.any():
                at = torch.from_numpy(tokens[hit])
                self.embeds[at] = mm.embeds[torch.from_numpy(index[hit])].to(self.embeds.dtype)
                self.mask[at] = True
                self.dirty = True
