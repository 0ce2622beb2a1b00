"""A projection with its LoRA delta, for every token's adapter at once (graph-safe).

Each LoRA-enabled ``nn.Linear`` carries ``lora_a`` [P·S·R, in] and one ``lora_b{j}`` [out_j, S·R]
per part j of its output LoRA is served on (P such parts: of q/k/v in ``qkv_proj``, gate/up in
``gate_up_proj``, else the one; a part not served gets no buffer and a zero delta),
where S is the number of adapter slots and R ``max_lora_rank``. Columns are part-major: part j of
slot s owns columns (j·S + s)·R … +R of A's rows and s·R … +R of ``lora_b{j}`` (ranks below R
zero-padded, the scaling folded into B; j counts served parts). For tokens with slots ``token_slot`` (−1: none)::

    h = (x A_allᵀ) ⊙ M,   M[t, c] = [token_slot[t] == (c // R) mod S]
    y = x Wᵀ + concat_j(h_j B_jᵀ)

skinny matmuls over every resident adapter and a mask: no gather, no loop, no data-dependent
shape, so one graph serves every mix of adapters. Each adapter's weights are read once a step
whatever the number of its tokens (the "punica" idea without its segment kernel), and no zero
block of a stacked projection is read. A token without an adapter gets exactly ``+ 0``: its
output equals the base model's bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn


def project(linear: nn.Linear, x: torch.Tensor, token_slot: torch.Tensor | None) -> torch.Tensor:
    y = linear(x)
    lora_a = getattr(linear, "lora_a", None)
    if lora_a is None or token_slot is None:
        return y
    slots, rank, parts = linear.lora_num_slots, linear.lora_rank, linear.lora_parts
    columns = (torch.arange(lora_a.shape[0], device=x.device) // rank) % slots
    h = nn.functional.linear(x, lora_a) * (token_slot[:, None] == columns[None, :]).to(x.dtype)
    sizes = linear.lora_part_sizes
    if len(sizes) == 1:
        return y + nn.functional.linear(h, linear.lora_b0)
    width = slots * rank
    deltas = [x.new_zeros(x.shape[0], n) for n in sizes]  # parts LoRA is not served on stay as they are
    for i, j in enumerate(parts):
        deltas[j] = nn.functional.linear(h[:, i * width : (i + 1) * width], getattr(linear, f"lora_b{j}"))
    return y + torch.cat(deltas, dim=-1)


def token_slots(model: nn.Module, token_req: torch.Tensor) -> torch.Tensor | None:
    """Each token's adapter slot (−1: none) from its row's (``model.lora_row_slot``), or None
    when the model serves no adapters."""
    rows = getattr(model, "lora_row_slot", None)
    if rows is None:
        return None
    return torch.where(token_req >= 0, rows[token_req.clamp(min=0)], -1)
