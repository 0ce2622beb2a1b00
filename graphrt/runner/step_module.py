"""The whole per-token computation of one step as one module: the unit graphrt compiles.

Integers in (token ids, positions, block tables, lengths, sampling parameters), token ids out.
Slot mapping, attention with its cache write, logits at the logits indices, the grammar bitmask
and sampling are all inside.
"""

from __future__ import annotations

import torch
from torch import nn

from graphrt.kernels import canonical
from graphrt.models.attention import AttentionInputs


class StepModule(nn.Module):
    def __init__(self, model: nn.Module, block_size: int) -> None:
        super().__init__()
        self.model = model
        self.block_size = block_size

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_req: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        logits_indices: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        seeds: torch.Tensor,
        offsets: torch.Tensor,
        bitmask: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        slot_mapping = canonical.slot_mapping(positions, token_req, block_tables, self.block_size)
        attn = AttentionInputs(block_tables, seq_lens, query_start_loc, token_req, slot_mapping)
        hidden = self.model(input_ids, positions, kv_caches, attn)
        logits = self.model.compute_logits(hidden, logits_indices)
        return canonical.sample(logits, bitmask, temperature, top_k, top_p, min_p, seeds, offsets)
