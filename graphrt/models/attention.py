"""The attention inputs of a step, and attention in its canonical unfused form.

Every step is flat: T tokens of R request rows. A request row r owns the blocks
``block_tables[r]``; token t belongs to row ``token_req[t]`` (−1 for padding) at ``positions[t]``.
Block 0 of every cache is the null block: padding writes land there and nothing reads them.
The math lives in ``graphrt.kernels.canonical``, the spelling the fusion passes recognise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphrt.kernels import canonical

compute_slot_mapping = canonical.slot_mapping


@dataclass
class AttentionInputs:
    block_tables: torch.Tensor  # [R, B] int64, unused entries point at the null block 0
    seq_lens: torch.Tensor  # [R] int64, context length of each row after this step
    query_start_loc: torch.Tensor  # [R + 1] int64, offsets of each row's tokens in the step
    token_req: torch.Tensor  # [T] int64, request row of each token, −1 for padding
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each token, −1 for padding
    lora_slot: torch.Tensor | None = None  # [T] int64, adapter slot of each token (−1: none), with LoRA


def attention(q, k, v, k_cache, v_cache, attn: AttentionInputs, scale: float) -> torch.Tensor:
    return canonical.attention(
        q,
        k,
        v,
        k_cache,
        v_cache,
        attn.slot_mapping,
        attn.block_tables,
        attn.seq_lens,
        attn.query_start_loc,
        attn.token_req,
        scale,
    )
