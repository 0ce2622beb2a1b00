"""A projection with its LoRA delta, for every token's adapter at once (graph-safe).

Each LoRA-enabled ``nn.Linear`` carries two buffers: ``lora_a`` [S·P·R, in] and ``lora_b``
[out, S·P·R], where S is the number of adapter slots, P the PEFT modules its output stacks (q/k/v:
3) and R ``max_lora_rank``; slot s owns the columns s·P·R … (s+1)·P·R (zero-padded ranks, B
block-diagonal over the parts, the scaling folded in). Then for tokens with slots ``token_slot``
(−1: none)::

    y = x Wᵀ + ((x A_allᵀ) ⊙ M) B_allᵀ,   M[t, c] = [token_slot[t] == c // (P·R)]

two skinny matmuls over every resident adapter and a mask: no gather, no loop, no data-dependent
shape, so one graph serves every mix of adapters. Each adapter's weights are read once a step
whatever the number of its tokens (the "punica" idea without its segment kernel). A token
without an adapter gets exactly ``+ 0``: its output equals the base model's bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn


def project(linear: nn.Linear, x: torch.Tensor, token_slot: torch.Tensor | None) -> torch.Tensor:
    y = linear(x)
    lora_a = getattr(linear, "lora_a", None)
    if lora_a is None or token_slot is None:
        return y
    width = lora_a.shape[0]
    per_slot = width // linear.lora_num_slots
    columns = torch.arange(width, device=x.device) // per_slot
    mask = (token_slot[:, None] == columns[None, :]).to(x.dtype)
    h = nn.functional.linear(x, lora_a) * mask
    return y + nn.functional.linear(h, linear.lora_b)


def token_slots(model: nn.Module, token_req: torch.Tensor) -> torch.Tensor | None:
    """Each token's adapter slot (−1: none) from its row's (``model.lora_row_slot``), or None
    when the model serves no adapters."""
    rows = getattr(model, "lora_row_slot", None)
    if rows is None:
        return None
    return torch.where(token_req >= 0, rows[token_req.clamp(min=0)], -1)
